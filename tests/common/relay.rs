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
    /// A CancelRequest waits this long before it goes on (the cancel
    /// reaches PostgreSQL late; nothing else is slowed).
    pub cancel_delay: Duration,
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
            const CANCEL: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
            if self.from_client && buf[..n].starts_with(&CANCEL) {
                tokio::time::sleep(self.faults.cancel_delay).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

/// Relays like a pooler that refuses a startup option it does not know
/// (PgBouncer does, unless told to ignore it): a startup packet holding
/// `marker` is answered FATAL 08P01 and closed; anything else is relayed to
/// `target_port`. SSLRequest is answered `N`. Returns the port.
pub async fn refusing_relay(target_port: u16, marker: &'static [u8]) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            tokio::spawn(refuse_or_relay(inbound, target_port, marker));
        }
    });
    port
}

async fn refuse_or_relay(mut inbound: TcpStream, target_port: u16, marker: &[u8]) {
    const SSL_REQUEST: u32 = 80_877_103;
    let startup = loop {
        let mut len = [0u8; 4];
        if inbound.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut body = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
        if inbound.read_exact(&mut body).await.is_err() {
            return;
        }
        if body == SSL_REQUEST.to_be_bytes() {
            if inbound.write_all(b"N").await.is_err() {
                return;
            }
            continue;
        }
        break [&len[..], &body].concat();
    };
    if startup.windows(marker.len()).any(|w| w == marker) {
        let mut fields = Vec::new();
        for (field, value) in [
            (b'S', "FATAL"),
            (b'V', "FATAL"),
            (b'C', "08P01"),
            (
                b'M',
                "unsupported startup parameter in options: pgcache.origin",
            ),
        ] {
            fields.push(field);
            fields.extend_from_slice(value.as_bytes());
            fields.push(0);
        }
        fields.push(0);
        let mut frame = vec![b'E'];
        frame.extend_from_slice(&(fields.len() as u32 + 4).to_be_bytes());
        frame.extend(fields);
        let _ = inbound.write_all(&frame).await;
        return;
    }
    let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target_port)).await else {
        return;
    };
    if outbound.write_all(&startup).await.is_ok() {
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
    }
}
