//! The connection to Redis: one node (a `ConnectionManager` that
//! reconnects by itself) or a cluster.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::SharedTier;
use crate::config::redact;

/// A connection to a single Redis or to a cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl SharedTier {
    /// Establishes the connection, retrying until it works.
    pub(super) async fn connect(&self, drain: &CancellationToken) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = async {
                if self.nodes.cluster {
                    let mut builder =
                        redis::cluster::ClusterClient::builder(self.nodes.urls.clone());
                    if let Some(certs) = self.tls_certificates()? {
                        builder = builder.certs(certs);
                    }
                    let client = builder
                        .connection_timeout(self.timeout.max(Duration::from_secs(1)))
                        .response_timeout(self.timeout)
                        .build()?;
                    Ok::<_, redis::RedisError>(Conn::Cluster(client.get_async_connection().await?))
                } else {
                    let client = self.client(&self.nodes.urls[0])?;
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout.max(Duration::from_secs(1))))
                        .set_response_timeout(Some(self.timeout))
                        .set_max_delay(Duration::from_secs(1));
                    Ok(Conn::Single(
                        ConnectionManager::new_with_config(client, config).await?,
                    ))
                }
            };
            let result = tokio::select! {
                r = attempt => r,
                _ = drain.cancelled() => return,
            };
            match result {
                Ok(conn) => {
                    let _ = self.conn.set(conn);
                    info!(redis = %self.describe(), "shared tier connected");
                    return;
                }
                Err(e) => {
                    warn!(redis = %self.describe(), error = %e, retry_in = ?backoff, "cannot reach Redis: local tier only until it can be reached");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = drain.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The CA certificates of `redis.ca_file`, if set.
    fn tls_certificates(&self) -> redis::RedisResult<Option<redis::TlsCertificates>> {
        let Some(path) = &self.nodes.ca_file else {
            return Ok(None);
        };
        let root_cert = std::fs::read(path)?;
        Ok(Some(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root_cert),
        }))
    }

    /// A client for one node, trusting `redis.ca_file` for `rediss://`.
    pub(super) fn client(&self, url: &str) -> redis::RedisResult<redis::Client> {
        match self.tls_certificates()? {
            Some(certs) if url.starts_with("rediss://") => {
                redis::Client::build_with_tls(url, certs)
            }
            _ => redis::Client::open(url),
        }
    }

    pub(super) fn describe(&self) -> String {
        self.nodes
            .urls
            .iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(",")
    }
}
