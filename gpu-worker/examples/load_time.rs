//! Load time and resident memory of a GGUF model, a few times over, with the process's peak
//! resident memory (the first load's peak is the one that counts: later loads reuse freed
//! memory): `cargo run --release -p hearth-worker --example load_time [-- PATH]`. The first
//! load reads the file from the page cache when it is there; drop the cache first
//! (`echo 1 > /proc/sys/vm/drop_caches`) for a cold one.
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
            "load {s:.2} s, rss {} MB, peak rss {} MB, weights {} MB",
            hearth_worker::device::rss_bytes() >> 20,
            hearth_worker::device::peak_rss_bytes() >> 20,
            m.weights_bytes() >> 20
        );
        drop(m);
    }
}
