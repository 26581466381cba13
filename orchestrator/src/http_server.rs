//! The HTTP accept loop, with the limits a public server needs: a deadline for each request's
//! header, a cap on open connections, and a shutdown that cannot be held open by idle or
//! half-open connections.
//!
//! A client that opens connections and sends nothing, or a header a byte at a time (slowloris),
//! is closed when the header deadline passes; connections beyond the cap wait in the kernel's
//! backlog until one closes. On shutdown the server stops accepting, closes idle connections at
//! once, lets requests in progress finish (replies are stopped by the caller after its grace
//! period), and returns at `hard_deadline` whatever is still open.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Limits on connections.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Time from a connection's opening (or its last reply) to the end of a request's header.
    pub header_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
}

/// Open files this process may use, after raising the soft limit to the hard one (Linux
/// starts services with a soft limit of 1,024, far below what a chat server's streams need).
pub fn raise_open_files_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    Some(lim.rlim_cur)
}

/// Most connections open by default: with each connection's buffer capped at
/// [`MAX_CONNECTION_BUFFER`] and request bodies at `MAX_BODY_BYTES_IN_FLIGHT` in all, their
/// memory stays well inside a 1 GiB pod.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 2048;

/// Largest buffer one connection reads into (a request's header must fit); hyper's default is
/// about 400 KiB.
pub const MAX_CONNECTION_BUFFER: usize = 64 << 10;

/// The default connection cap: [`DEFAULT_MAX_CONNECTIONS`], or the open-file limit less a
/// reserve for the database, Redis, workers and files where that is lower.
pub fn default_max_connections() -> usize {
    let files = raise_open_files_limit().unwrap_or(1024);
    files.saturating_sub(512).clamp(64, DEFAULT_MAX_CONNECTIONS) as usize
}

/// Serves `app` on `listener` until `shutdown` turns true; see the module docs.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    mut shutdown: watch::Receiver<bool>,
    hard_deadline: Duration,
) {
    let builder = Arc::new(http1_builder(&limits));
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Every connection task holds a receiver; all dropped means all closed.
    let (open_tx, open_rx) = watch::channel(());
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = shutdown.wait_for(|s| *s) => break,
        };
        let (stream, _peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors or a connection reset before accept: not fatal.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.wait_for(|s| *s) => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let mut stop = shutdown.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            connection(&builder, stream, service, &mut stop).await;
            drop(open);
            drop(permit);
        });
    }
    drop(listener);
    drop(open_rx);
    if tokio::time::timeout(hard_deadline, open_tx.closed())
        .await
        .is_err()
    {
        tracing::warn!(
            open = open_tx.receiver_count(),
            "connections still open at the shutdown deadline; closing them"
        );
    }
}

/// The connections' HTTP/1 settings. HTTP/1 only, served directly: an HTTP/1-or-2 server first
/// reads a connection's opening bytes to tell the versions apart, with no deadline, so a client
/// that connects and sends nothing would hold its place for good. Here the header deadline runs
/// from the start.
fn http1_builder(limits: &HttpLimits) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_CONNECTION_BUFFER);
    builder
}

/// Serves one connection until it ends, shutting it down gracefully once `stop` is set. An
/// upgrade (WebSocket) hands the connection to its own task (see `api::ws`).
async fn connection<S>(
    builder: &http1::Builder,
    stream: tokio::net::TcpStream,
    service: S,
    stop: &mut watch::Receiver<bool>,
) where
    S: hyper::service::HttpService<hyper::body::Incoming> + Send,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as hyper::body::Body>::Data: Send,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let conn = builder
        .serve_connection(TokioIo::new(Lingering(Some(stream))), service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// How long, and for how many bytes at most, a closed connection is still read from.
const LINGER_FOR: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;

/// A connection that, once the server is done with it, still reads (and discards) what the
/// client goes on sending for a moment before it closes: a lingering close, as nginx does. A
/// request answered before its body was read (413: too large; 401) is followed by the rest of
/// that body; closing with it unread would make the kernel reset the connection, and a client
/// still writing the body would get the reset instead of the answer.
struct Lingering(Option<tokio::net::TcpStream>);

impl Lingering {
    fn stream(&mut self) -> std::io::Result<&mut tokio::net::TcpStream> {
        self.0
            .as_mut()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotConnected))
    }
}

impl tokio::io::AsyncRead for Lingering {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

impl tokio::io::AsyncWrite for Lingering {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.stream() {
            Ok(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(s) => std::pin::Pin::new(s).poll_flush(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let (Some(mut stream), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        rt.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            // The answer is out: say so (FIN), then take what still comes, until the client
            // closes too, or for a moment at most.
            let _ = stream.shutdown().await;
            let drain = async {
                let mut buf = vec![0u8; 16 << 10];
                let mut read = 0;
                while read < LINGER_BYTES {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read += n,
                    }
                }
            };
            let _ = tokio::time::timeout(LINGER_FOR, drain).await;
        });
    }
}
