//! `hearth-otlp-sink`: an OTLP/gRPC trace receiver that keeps count of what it is sent, for
//! measuring what tracing costs against a real receiver (`make bench-tracing`). Prints
//! `{"listening": "<addr>"}` once it listens, and `{"spans": n}` when stopped (SIGTERM or
//! SIGINT).

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "hearth-otlp-sink",
    about = "An OTLP/gRPC trace receiver that counts spans"
)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (received, addr, gone) = hearth_e2e::otlp::receiver_at(&args.listen).await;
    say(&serde_json::json!({ "listening": addr.to_string() }));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    gone.now().await;
    let spans = received.spans.lock().map(|s| s.len()).unwrap_or(0);
    say(&serde_json::json!({ "spans": spans }));
}

/// One JSON line on stdout, flushed at once (a script waits for it).
fn say(line: &serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
