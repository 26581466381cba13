//! `hearth-bench` against a real stack (tiny model): both APIs, every workload, the table and
//! the JSON report; and it refuses targets off this machine.

use hearth_e2e::stack::{bench_bin, path, Db, Stack};
use serde_json::Value;

fn bench(args: &[&str]) -> std::process::Output {
    std::process::Command::new(bench_bin())
        .args(args)
        .output()
        .expect("run hearth-bench")
}

#[tokio::test]
async fn hearth_bench_measures_both_apis_and_writes_its_report() {
    let s = Stack::start("bench", Db::Sqlite, 1, &[]).await;
    let k = s.key("bench").await;
    let url = format!("http://{}", s.addr());
    let out = s.assets.dir.join("report.json");
    let common = [
        "--url",
        &url,
        "--api-key",
        &k,
        "--quiet",
        "--output-tokens",
        "6",
    ];

    let o = bench(&[&common[..], &["--concurrency", "1,3", "--requests", "3"]].concat());
    let sweep_out = out.with_extension("sweep.json");
    let o2 = bench(
        &[
            &common[..],
            &[
                "--concurrency",
                "2",
                "--requests",
                "2",
                "--out",
                &path(&sweep_out),
            ],
        ]
        .concat(),
    );
    for o in [&o, &o2] {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("concurrency 1") && table.contains("concurrency 3"),
        "{table}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&sweep_out).expect("report")).expect("json");
    let row = &report["results"][0];
    assert_eq!(row["requests"], 2);
    assert_eq!(row["errors"], 0, "{row}");
    assert_eq!(row["output_tokens"], 12, "fixed-length replies: {row}");
    assert!(
        row["ttft_ms"]["p99"].as_f64().is_some_and(|v| v > 0.0),
        "{row}"
    );
    assert!(report["machine"]["cpus"].is_u64());

    // The native multi-turn workload reports per-turn figures and the session cache.
    let o = bench(
        &[
            &common[..],
            &[
                "--api",
                "native",
                "--workload",
                "multi-turn",
                "--sessions",
                "2",
                "--turns",
                "3",
                "--turn-words",
                "8",
                "--out",
                &path(&out),
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("json");
    let row = &report["results"][0];
    assert_eq!(
        (row["requests"].as_u64(), row["errors"].as_u64()),
        (Some(6), Some(0)),
        "{row}"
    );
    let turns = row["turns"].as_array().expect("turns");
    assert_eq!(turns.len(), 3);
    assert!(
        turns[2]["cached_ratio"].as_f64().is_some_and(|c| c > 0.3),
        "turn 3 reuses the session cache: {row}"
    );

    // A Poisson run is bounded by its request count.
    let o = bench(
        &[
            &common[..],
            &["--workload", "rate", "--rate", "20", "--requests", "4"],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("rate 20/s"));

    // Only this machine.
    let o = bench(&["--url", "http://10.1.2.3:8080", "--quiet"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("loopback"));
    s.finish().await;
}
