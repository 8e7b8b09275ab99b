//! A loopback TCP proxy whose live connections can be cut, to simulate a network failure
//! between two peers (neither side closes cleanly; each sees its transport end).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// A running proxy to one address.
#[derive(Debug)]
pub struct Proxy {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    cut: Arc<Notify>,
}

impl Proxy {
    /// Starts a proxy on a free loopback port forwarding every connection to `to`.
    pub async fn start(to: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let cut = Arc::new(Notify::new());
        let cut2 = cut.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let cut = cut2.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(to).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        () = cut.notified() => {}
                    }
                });
            }
        });
        Self { addr, cut }
    }

    /// Cuts every connection open now (new ones are still forwarded).
    pub fn cut(&self) {
        self.cut.notify_waiters();
    }
}
