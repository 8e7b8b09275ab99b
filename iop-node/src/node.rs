//! The composed Node: what an embedder starts, and what the `iop-node` binary runs.
//!
//! [`Node::start`] runs the supervisor ([`crate::run_node`]: dial, register, apply the Edge's
//! config, serve runs and tunnels, reconnect under the seed's policy) on a task of its own and,
//! for a Node built from a config file ([`Node::from_config`]), re-reads the TLS files every
//! `tls.reload_sec`. [`Node::stop`] cancels it and returns how it ended.
//!
//! ```no_run
//! # async fn example(tls: std::sync::Arc<rustls::ClientConfig>) {
//! use iop_node::{AdapterRegistry, Node, NodeOptions};
//!
//! let options = NodeOptions::new("node-1", "edge.internal:7443", "edge.internal", tls)
//!     .expect("valid options")
//!     .with_adapters(AdapterRegistry::with_builtins());
//! let node = Node::start(options);
//! // ... serve until your service stops ...
//! let exit = node.stop().await;
//! # let _ = exit;
//! # }
//! ```

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::NodeBuilt;
use crate::{Exit, NodeOptions, run_node};

/// A running Node. Dropping it leaves the supervisor running until the runtime ends; call
/// [`Node::stop`] to end it.
#[derive(Debug)]
pub struct Node {
    node_id: String,
    shutdown: CancellationToken,
    task: JoinHandle<Exit>,
}

impl Node {
    /// Starts the supervisor with `options`.
    pub fn start(options: NodeOptions) -> Self {
        let shutdown = CancellationToken::new();
        let node_id = options.node_id.clone();
        let task = tokio::spawn(run_node(options, shutdown.clone()));
        Self {
            node_id,
            shutdown,
            task,
        }
    }

    /// Starts a Node built from its config file ([`crate::config::NodeConfigFile::build`]),
    /// reloading the TLS files when the file asks for it (`tls.reload_sec`).
    pub fn from_config(built: NodeBuilt) -> Self {
        let node = Self::start(built.options);
        if let Some(every) = built.reload {
            let paths = workload_identity::reload::TlsPaths {
                ca: built.ca,
                cert: built.cert,
                key: built.key,
            };
            workload_identity::reload::spawn(
                built.tls,
                paths,
                every,
                "node",
                node.shutdown.clone(),
            );
        }
        node
    }

    /// The Node id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Whether the supervisor has ended on its own (retries exhausted, or a fatal error).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the supervisor to end on its own, without stopping it.
    pub async fn wait(self) -> Exit {
        join(self.task).await
    }

    /// Runs until the supervisor ends on its own or `shutdown` completes (then stops it), and
    /// returns how it ended: what a service's `main` does.
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> Exit {
        tokio::select! {
            ended = &mut self.task => join_result(ended),
            () = shutdown => self.stop().await,
        }
    }

    /// Stops the Node (every active run is cancelled, the connection closed) and returns how
    /// it ended.
    pub async fn stop(self) -> Exit {
        self.shutdown.cancel();
        join(self.task).await
    }
}

async fn join(task: JoinHandle<Exit>) -> Exit {
    join_result(task.await)
}

fn join_result(result: Result<Exit, tokio::task::JoinError>) -> Exit {
    match result {
        Ok(exit) => exit,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Exit::Shutdown,
    }
}
