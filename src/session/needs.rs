//! What the engine waits for, met by the driver ([`Need`]): the cache's
//! waits, pgcache's own queries on the client's connection (the engine
//! asks them and takes their answers, [`super::engine::OwnStep`]; the
//! driver takes a connection for them in transaction mode, sends them and
//! reads their answers), catalog facts being fetched, and what a client's
//! statement needs of pgcache before it goes out (see
//! [`crate::classify::prerequisites`]): databases pgcache lets go of (see
//! [`crate::cache::hold`]), and tables taken out of its publication.

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::engine::{Need, Verdict};
use super::relay::{Session, ctx};
use super::traffic::Leg;
use crate::invalidation::take_out_for_unlogged;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Gets what the engine needs to decide on a frame, and tells it.
    pub(super) async fn meet(&mut self, need: Need) -> Result<(), SessionError> {
        match need {
            Need::Prerequisites(needs) => {
                let db = self.engine.startup().database().to_owned();
                for name in &needs.free_databases {
                    if let Some(paused) = self.app.streams.release(name, &db).await {
                        self.engine.hold_paused(paused);
                    }
                }
                if let Some(publication) = self.app.publication() {
                    for table in &needs.unpublish {
                        take_out_for_unlogged(&self.app.upstream, &db, &publication, table).await;
                    }
                }
                self.engine.prerequisites_met();
            }
            Need::Own => self.converse().await?,
            Need::Fetched { rels, funcs } => {
                let rels: Vec<&str> = rels.iter().map(String::as_str).collect();
                let funcs: Vec<&str> = funcs.iter().map(String::as_str).collect();
                let wait = self.engine.first_read_wait();
                let db = self.engine.db();
                // Asked for with the statement's other actions, which run
                // once it is decided: the fetch must start now.
                self.app.fetch_catalog(db);
                self.app
                    .cache
                    .wait_for_facts(db, (&rels, &funcs), wait)
                    .await;
                self.engine.facts_met();
            }
            Need::Cache(wait) => self.app.cache.wait(wait, self.engine.lookup_waited()).await,
        }
        Ok(())
    }

    /// Runs the own queries the engine asked, to the last answer; then the
    /// connection is closed if the engine could not take an answer.
    pub(super) async fn converse(&mut self) -> Result<(), SessionError> {
        while self.engine.own_pending() {
            if !self.attached() {
                match Box::pin(self.take_connection(false)).await {
                    Ok(()) => {}
                    Err(SessionError::Pool(e)) => {
                        // No connection: what waited goes on without the
                        // answer, and the statement fails at once with
                        // the same error.
                        self.engine.no_connection(&ctx(&self.app, &self.entry), e);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            if let Some(request) = self.engine.own_request() {
                let r = self.server()?.write_all(&request).await;
                r.map_err(SessionError::BackendIo)?;
            }
            // Its answer is read as any other (`Engine::on_backend`).
            match self.server()?.fill().await {
                Ok(0) => {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(SessionError::BackendIo(eof));
                }
                Ok(_) => self.relay_from(Leg::Primary).await?,
                Err(e) => return Err(SessionError::BackendIo(e)),
            }
        }
        match self.engine.take_verdict() {
            None => Ok(()),
            Some(Verdict::Close) => {
                self.drop_backend();
                Ok(())
            }
            Some(Verdict::Fail(e)) => {
                self.drop_backend();
                Err(e)
            }
        }
    }
}
