//! The worker's K/V options through the whole stack, as an operator would set them on the
//! worker binary: int8 K/V, and the disk tier that keeps idle sessions evicted from memory.

use hearth_e2e::stack::{json_turn, new_session, worker_metric, Db, Stack};
use hearth_worker::fixtures::TinySpec;

/// Two turns of one session: both complete, and the second reuses the first's cache.
async fn two_turns(s: &Stack, key: &str) -> (u64, u64) {
    let sid = new_session(s.addr(), key).await;
    let one = json_turn(s.addr(), key, &sid, "tell me about the sea", 12).await;
    assert_eq!(one["status"], "complete", "{one}");
    assert!(
        !one["content"].as_str().unwrap_or_default().is_empty(),
        "{one}"
    );
    let two = json_turn(s.addr(), key, &sid, "and the harbour?", 12).await;
    assert_eq!(two["status"], "complete", "{two}");
    let prompt1 = one["usage"]["prompt_tokens"].as_u64().expect("prompt");
    let cached2 = two["usage"]["cached_tokens"].as_u64().expect("cached");
    (prompt1, cached2)
}

#[tokio::test]
async fn int8_kv_serves_sessions_and_keeps_their_caches() {
    let flags = ["--kv-budget", "64MiB", "--kv-dtype", "int8"];
    let s = Stack::start_full("kv_int8", &TinySpec::default(), Db::Sqlite, 1, &flags, &[]).await;
    let k = s.key("alice").await;
    let (prompt1, cached2) = two_turns(&s, &k).await;
    assert!(
        cached2 >= prompt1,
        "turn 2 cached {cached2} of turn 1's {prompt1}"
    );
    // int8 rows take about half the bytes of f16 ones: the same budget holds about twice the
    // blocks of an f16 worker's.
    let f16 = Stack::start("kv_f16", Db::Sqlite, 1, &[]).await;
    let blocks = "hearth_worker_kv_blocks_total";
    let int8_blocks = worker_metric(&s.workers[0], blocks).await;
    let f16_blocks = worker_metric(&f16.workers[0], blocks).await;
    assert!(
        int8_blocks > 1.5 * f16_blocks,
        "int8 {int8_blocks} blocks, f16 {f16_blocks}"
    );
}

#[tokio::test]
async fn the_disk_tier_brings_back_a_session_evicted_from_memory() {
    let dir =
        std::env::temp_dir().join(format!("hearth-kv-tier-{}", uuid::Uuid::new_v4().simple()));
    let dir_arg = dir.display().to_string();
    let flags = [
        "--kv-budget",
        "1MiB",
        "--kv-disk-gb",
        "0.01",
        "--kv-disk-dir",
        dir_arg.as_str(),
    ];
    let s = Stack::start_full("kv_disk", &TinySpec::default(), Db::Sqlite, 1, &flags, &[]).await;
    let k = s.key("alice").await;
    let first = new_session(s.addr(), &k).await;
    let one = json_turn(s.addr(), &k, &first, "the first session's opening words", 8).await;
    let prompt1 = one["usage"]["prompt_tokens"].as_u64().expect("prompt");
    // Other sessions fill the memory budget until the first one's cache is evicted.
    let evictions = "hearth_worker_session_evictions_total";
    for i in 0..200 {
        if worker_metric(&s.workers[0], evictions).await > 0.0 {
            break;
        }
        let other = new_session(s.addr(), &k).await;
        json_turn(
            s.addr(),
            &k,
            &other,
            &format!("another session, number {i}"),
            8,
        )
        .await;
    }
    assert!(
        worker_metric(&s.workers[0], evictions).await > 0.0,
        "nothing was evicted"
    );
    // The first session's next turn finds its cache again, from disk.
    let two = json_turn(s.addr(), &k, &first, "and then?", 4).await;
    let cached = two["usage"]["cached_tokens"].as_u64().expect("cached");
    assert!(
        cached >= prompt1,
        "cached {cached} of the first turn's {prompt1}"
    );
    s.finish().await;
    let _ = std::fs::remove_dir_all(dir);
}
