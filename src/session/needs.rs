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
use super::engine::{Need, OwnStep, Verdict};
use super::relay::{Session, ctx};
use crate::classify::prerequisites::prerequisites;
use crate::invalidation::{quote_literal, take_out_for_unlogged};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::stream::ReadError;
use crate::protocol::{extended, frontend as fe};

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Gets what the engine needs to decide on `frame`, and tells it.
    pub(super) async fn meet(&mut self, need: Need, frame: &[u8]) -> Result<(), SessionError> {
        match need {
            Need::Prerequisites => {
                self.meet_prerequisites(frame).await?;
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
            let Some(request) = self.engine.own_request() else {
                break;
            };
            self.server()?
                .write_all(&request)
                .await
                .map_err(SessionError::BackendIo)?;
            loop {
                let frame = match self.server()?.read_frame().await {
                    Ok(Some(frame)) => frame,
                    Ok(None) => {
                        let eof = std::io::ErrorKind::UnexpectedEof.into();
                        return Err(SessionError::BackendIo(eof));
                    }
                    Err(ReadError::Io(e)) => return Err(SessionError::BackendIo(e)),
                    Err(e) => return Err(SessionError::BackendFrame(e)),
                };
                match self
                    .engine
                    .on_own_frame(&ctx(&self.app, &self.entry), frame)
                {
                    OwnStep::Read => {}
                    OwnStep::ToClient(frame) => self
                        .client
                        .write_all(&frame)
                        .await
                        .map_err(SessionError::ClientIo)?,
                    OwnStep::Answered => break,
                }
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

    /// For a Query or Parse frame whose text names a database or UNLOGGED.
    async fn meet_prerequisites(&mut self, frame: &[u8]) -> Result<(), SessionError> {
        if !self.app.cache.replication_on() {
            return Ok(());
        }
        let body = &frame[HEADER_LEN..];
        let text = if frame[0] == fe::PARSE {
            match extended::parse(body) {
                Some(p) => p.query,
                None => return Ok(()),
            }
        } else {
            body.split(|b| *b == 0).next().unwrap_or_default()
        };
        let Ok(sql) = std::str::from_utf8(text) else {
            return Ok(());
        };
        let needs = prerequisites(sql);
        for name in needs.free_databases {
            let via = self.engine.startup().database();
            if let Some(paused) = self.app.streams.release(&name, via).await {
                self.engine.hold_paused(paused);
            }
        }
        for table in needs.unpublish {
            self.unpublish(&table).await?;
        }
        Ok(())
    }

    /// Takes `table` out of pgcache's publication for a `SET UNLOGGED`
    /// ([`take_out_for_unlogged`]). The name is resolved in the client's
    /// own session (its search_path) when it is idle.
    async fn unpublish(&mut self, table: &str) -> Result<(), SessionError> {
        let Some(publication) = self.app.publication() else {
            return Ok(());
        };
        let qualified = if self.backend_idle() {
            let sql = format!(
                "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class c \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.oid = pg_catalog.to_regclass({})",
                quote_literal(table)
            );
            self.engine.ask_rows(&sql);
            self.converse().await?;
            let rows = self.engine.take_own_rows().unwrap_or_default();
            match rows
                .into_iter()
                .next()
                .and_then(|r| r.into_iter().next().flatten())
            {
                Some(name) => name,
                // No such table: the statement fails on its own.
                None => return Ok(()),
            }
        } else {
            table.to_owned()
        };
        let db = self.engine.startup().database();
        take_out_for_unlogged(&self.app.upstream, db, &publication, &qualified).await;
        Ok(())
    }
}
