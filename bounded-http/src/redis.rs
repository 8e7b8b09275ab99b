//! One Redis server or a Redis Cluster behind one connection type, for the workspace's Redis
//! stores (the Edge's shared rate limits, the proxy-pool controller's store): the same script
//! and pipeline calls go to either, redis-rs's cluster client routing each by its keys' hash
//! tag (so every key of one call must share a slot) and following slot moves and failovers.
//!
//! Kept here, beside the other bounded clients of the workspace's services, rather than in
//! each store: redis-rs has no such union of its own.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};

/// Where a store's Redis is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// One server (`redis://host:port/db`; `rediss://` for TLS).
    Single(String),
    /// A Redis Cluster reached through any of these seed URLs (the client learns the rest).
    Cluster(Vec<String>),
}

impl Target {
    /// `url` as one server, or with `cluster` as comma-separated seed URLs.
    pub fn parse(url: &str, cluster: bool) -> Self {
        if cluster {
            Self::Cluster(
                url.split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .map(str::to_owned)
                    .collect(),
            )
        } else {
            Self::Single(url.to_owned())
        }
    }
}

/// A connection to one server (a `ConnectionManager`, reconnecting in the background) or to
/// a cluster.
#[derive(Clone)]
pub enum Connection {
    /// One server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(redis::cluster_async::ClusterConnection),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Connection::Single",
            Self::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl Connection {
    /// Connects to `target`, every call bounded by `timeout` (connecting, and each
    /// response): a store call fails rather than hang while Redis is down.
    pub async fn connect(target: &Target, timeout: Duration) -> redis::RedisResult<Self> {
        match target {
            Target::Single(url) => {
                let client = redis::Client::open(url.as_str())?;
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500))
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout));
                Ok(Self::Single(
                    ConnectionManager::new_with_config(client, config).await?,
                ))
            }
            Target::Cluster(seeds) => {
                let client =
                    redis::cluster::ClusterClient::builder(seeds.iter().map(String::as_str))
                        .connection_timeout(timeout)
                        .response_timeout(timeout)
                        .build()?;
                Ok(Self::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// Whether it is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}
