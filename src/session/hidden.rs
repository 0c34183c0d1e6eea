//! pgcache's own queries on a client's backend connection ("hidden
//! queries"): the catalog snapshot and the session's settings. They run
//! only while the backend is idle ([`Session::backend_idle`]), so they can
//! never interleave with the client's work.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::debug;

use super::SessionError;
use super::relay::Session;
use crate::cache::catalog::{Catalog, snapshot_sql};
use crate::cache::key;
use crate::classify::BypassReason;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, backend as be, extended, messages};

/// Rows of a hidden query, as text.
type Rows = Vec<Vec<Option<String>>>;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// The database's catalog snapshot, loaded now if it is missing or
    /// stale and the backend is idle.
    pub(super) async fn catalog(&mut self) -> Result<Option<(u64, Arc<Catalog>)>, SessionError> {
        if let Some(c) = self.db.catalog.current() {
            return Ok(Some(c));
        }
        if !self.backend_idle() {
            return Ok(None);
        }
        let generation = self.db.catalog.generation();
        let publication = self
            .app
            .cache
            .replication_on()
            .then(|| self.app.config().replication.publication.clone());
        let Some(rows) = self
            .hidden_query(&snapshot_sql(publication.as_deref()))
            .await?
        else {
            return Ok(None);
        };
        let catalog = Arc::new(Catalog::from_rows(&rows));
        debug!(
            relations = catalog.relation_count(),
            "catalog snapshot loaded"
        );
        self.db.catalog.set(generation, Arc::clone(&catalog));
        Ok(Some((generation, catalog)))
    }

    /// The hash of the session's identity and settings, read from the
    /// backend when they may have changed.
    pub(super) async fn session_prefix(
        &mut self,
    ) -> Result<Result<u128, BypassReason>, SessionError> {
        let generation = self.db.catalog.generation();
        if let Some((prefix, g)) = self.known.prefix
            && g == generation
        {
            return Ok(Ok(prefix));
        }
        if !self.backend_idle() {
            return Ok(Err(BypassReason::SettingsUnknown));
        }
        let Some((generation, catalog)) = self.catalog().await? else {
            return Ok(Err(BypassReason::CatalogUnavailable));
        };
        let mut sql = String::from(
            "SELECT current_user, session_user, pg_catalog.current_setting('default_transaction_isolation'), \
             (SELECT pg_catalog.string_agg(name || '=' || setting, E'\\n' ORDER BY name) \
              FROM pg_catalog.pg_settings WHERE name <> 'application_name')",
        );
        for name in &catalog.policy_settings {
            sql.push_str(", pg_catalog.current_setting('");
            sql.push_str(&name.replace('\'', "''"));
            sql.push_str("', true)");
        }
        let Some(rows) = self.hidden_query(&sql).await? else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        let Some(row) = rows.into_iter().next() else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        self.known.role = row.first().cloned().flatten();
        self.tx.default_strict = !matches!(
            row.get(2).and_then(|v| v.as_deref()),
            Some("read committed" | "read uncommitted")
        );
        let params = self
            .startup
            .params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()));
        let prefix = key::session_prefix(self.startup.database(), params, &row);
        self.known.prefix = Some((prefix, generation));
        Ok(Ok(prefix))
    }

    /// Runs pgcache's own simple query on the idle backend and returns its
    /// rows as text, or `None` if it failed. Notifications and parameter
    /// changes arriving meanwhile go on to the client; notices caused by the
    /// query itself do not.
    async fn hidden_query(&mut self, sql: &str) -> Result<Option<Rows>, SessionError> {
        self.backend
            .write_all(&messages::query(sql))
            .await
            .map_err(SessionError::BackendIo)?;
        let mut rows = Vec::new();
        let mut failed = false;
        loop {
            let frame = match self.backend.read_frame().await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(SessionError::BackendIo(eof));
                }
                Err(crate::protocol::stream::ReadError::Io(e)) => {
                    return Err(SessionError::BackendIo(e));
                }
                Err(e) => return Err(SessionError::BackendFrame(e)),
            };
            let body = &frame[HEADER_LEN..];
            match frame[0] {
                be::DATA_ROW => match extended::data_row(body) {
                    Some(row) => rows.push(row),
                    None => failed = true,
                },
                be::ERROR_RESPONSE => failed = true,
                be::READY_FOR_QUERY => {
                    if let Some(status) = body.first().and_then(|b| TxStatus::from_byte(*b)) {
                        self.tx.status = status;
                    }
                    return Ok((!failed).then_some(rows));
                }
                be::NOTIFICATION | be::PARAMETER_STATUS => {
                    self.client
                        .write_all(&frame)
                        .await
                        .map_err(SessionError::ClientIo)?;
                }
                _ => {}
            }
        }
    }
}
