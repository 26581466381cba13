//! Cold-load time and resident memory of a GGUF model, a few times over:
//! `cargo run --release -p hearth-worker --example load_time [-- PATH]`.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

fn main() {
    let path = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/hearth/models/gemma-3-270m-q4_k_m.gguf")
        });
    for _ in 0..4 {
        let t = std::time::Instant::now();
        let m = hearth_worker::model::load_gguf(&path).unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "load {s:.2} s, rss {} MB",
            hearth_worker::device::rss_bytes() >> 20
        );
        drop(m);
    }
}
