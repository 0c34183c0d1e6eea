//! Programs the property test ([`super::property`]) once failed on, kept
//! as they were found and run in every mode, caching on and off.

use super::model::{Exec, Program, Sql, Step};
use super::property::{Caching, Counts, Mode, through_engine};

/// Programs the property test once failed on, kept as they were found.
#[test]
fn the_programs_once_failed_on_pass() {
    use Sql::*;
    use Step::Query;
    let programs = [
        // A pipeline whose first read's idle ReadyForQuery came after its
        // BEGIN and write were decided: the write was forgotten, and the
        // read after it in the transaction served from the cache.
        vec![
            vec![Query(ReadOne(4)), Query(Begin), Query(Write(1))],
            vec![Query(ReadOne(4))],
        ],
        vec![
            vec![Query(ReadOne(1)), Query(Begin), Query(Write(1))],
            vec![Query(ReadOne(1))],
        ],
        // Transaction mode: the second session took the connection the
        // first had set `application_name` on, and was told the value its
        // own settings put back, which it had all along.
        vec![vec![Query(Set(1))], vec![Step::Other(ReadOne(1))]],
        // Transaction mode: a run of a statement never prepared (its
        // effects unknown, the settings read back) then a cancel; it
        // failed for the model, which had no Close for pgcache's own
        // statement of the read-back.
        vec![
            vec![Step::Batch(vec![Exec {
                sql: ReadOne(1),
                describe: false,
                max_rows: 0,
                named: Some(1),
            }])],
            vec![Query(Sleep)],
        ],
        // Transaction mode: a Parse of a name the client had prepared was
        // refused by pgcache in the server's place, and the server's
        // transaction went on where PostgreSQL's fails.
        vec![
            vec![Step::Prepare {
                name: 2,
                sql: ReadOne(1),
            }],
            vec![
                Step::Prepare {
                    name: 2,
                    sql: ReadOne(1),
                },
                Query(ReadOne(1)),
            ],
        ],
        // Transaction mode: a batch's Execute and Sync came after the
        // server's error for its Parse, and were owed answers the server
        // skips: the next batch's answers fell out of line (its Close got
        // no CloseComplete).
        vec![
            vec![Step::Batch(vec![Exec {
                sql: Bad,
                describe: false,
                max_rows: 0,
                named: Some(3),
            }])],
            vec![Step::Close(3)],
        ],
    ];
    for program in programs {
        let program = Program(program);
        for mode in [Mode::Session, Mode::Transaction] {
            for caching in [Caching::On, Caching::Off] {
                let result = through_engine(&program, &mut Counts::default(), mode, caching);
                assert!(
                    result.is_ok(),
                    "{mode:?}, {caching:?}: {program:?}: {result:?}"
                );
            }
        }
    }
}
