//! A TCP proxy on loopback that a test can cut, to part one process from a server (PostgreSQL,
//! Redis) for a while as a network partition does: while cut, nothing crosses in either
//! direction and new connections wait, but no connection is closed; once the cut ends, what
//! was held goes through. It can also slow the link down (a delay on everything it forwards).
//! A server that is down (restarting) closes the connections to it.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A proxy to one upstream address; stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    pub addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
    /// Milliseconds everything forwarded waits.
    delay: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a proxy");
        let addr = listener.local_addr().expect("proxy address");
        let cut = Arc::new(watch::Sender::new(false));
        let delay = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let rx = cut.subscribe();
        let slow = delay.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let rx = rx.clone();
                let slow = slow.clone();
                tokio::spawn(async move {
                    let _ = client.set_nodelay(true);
                    open(rx.clone()).await;
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        () = pipe(cr, sw, rx.clone(), slow.clone()) => {}
                        () = pipe(sr, cw, rx, slow) => {}
                    }
                });
            }
        });
        Self {
            addr,
            cut,
            delay,
            task,
        }
    }

    /// Makes everything forwarded, each way, wait `delay` first.
    pub fn slow(&self, delay: std::time::Duration) {
        self.delay.store(
            delay.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Cuts the link (`true`) or mends it (`false`).
    pub fn cut(&self, on: bool) {
        self.cut.send_replace(on);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until the link is not cut.
async fn open(mut cut: watch::Receiver<bool>) {
    let _ = cut.wait_for(|c| !c).await;
}

/// Copies `from` to `to` while the link is open, holding what it read while it is cut, after
/// the delay.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: watch::Receiver<bool>,
    delay: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        open(cut.clone()).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let ms = delay.load(std::sync::atomic::Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        open(cut.clone()).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
