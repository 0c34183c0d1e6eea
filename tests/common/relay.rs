//! An in-test TCP relay, for faults a real network makes: delays, and
//! black holes (connections that stop forwarding without closing).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// What the relay does to the connections it carries.
#[derive(Clone, Default)]
pub struct Faults {
    /// Each chunk from the server waits this long before it goes on.
    pub delay: Duration,
    /// While set, connections whose client sent `frozen_marker` stop
    /// forwarding, both ways.
    pub freeze: Arc<AtomicBool>,
    pub frozen_marker: &'static [u8],
}

/// Relays TCP connections from a free port to `target_port` on 127.0.0.1;
/// returns the port.
pub async fn relay(target_port: u16, faults: Faults) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(("127.0.0.1", target_port)).await else {
                continue;
            };
            let marked = Arc::new(AtomicBool::new(false));
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            let up = Pipe {
                faults: faults.clone(),
                marked: Arc::clone(&marked),
                from_client: true,
            };
            let down = Pipe {
                faults: faults.clone(),
                marked,
                from_client: false,
            };
            tokio::spawn(up.run(ri, wo));
            tokio::spawn(down.run(ro, wi));
        }
    });
    port
}

struct Pipe {
    faults: Faults,
    /// The client sent the freeze marker.
    marked: Arc<AtomicBool>,
    from_client: bool,
}

impl Pipe {
    async fn run(self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
        let mut buf = vec![0u8; 64 * 1024];
        let marker = self.faults.frozen_marker;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if self.from_client
                && !marker.is_empty()
                && buf[..n].windows(marker.len()).any(|w| w == marker)
            {
                self.marked.store(true, Ordering::Release);
            }
            while self.marked.load(Ordering::Acquire) && self.faults.freeze.load(Ordering::Acquire)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if !self.from_client && !self.faults.delay.is_zero() {
                tokio::time::sleep(self.faults.delay).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}
