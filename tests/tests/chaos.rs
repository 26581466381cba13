//! A short seeded chaos run (`make chaos` runs the long one): three replicas and two scripted
//! workers on PostgreSQL and Redis of their own, six clients of four turns each through random
//! replicas, while `kill -9`, SIGSTOP and network cuts strike every 1.5 s, and Redis and
//! PostgreSQL restart once each. Every turn must be stored once, complete, with the text its
//! client was shown, event ids without gaps or repeats, and no client left waiting.
//! `HEARTH_CHAOS_SEED` replays a run; the report prints its seed.

use std::time::Duration;

use hearth_e2e::chaos::client::Plan;
use hearth_e2e::chaos::cluster::{Model, Shape};
use hearth_e2e::chaos::faults::Storm;
use hearth_e2e::chaos::{run, seed_or, Config};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_turn_is_lost_or_changed_under_a_storm_of_faults() {
    let assets = hearth_e2e::stack::assets("chaos_short");
    let seed = seed_or(hearth_e2e::rng::seed());
    let out = std::env::temp_dir().join(format!("hearth-chaos-{seed:#x}-{}", std::process::id()));
    let report = run(Config {
        shape: Shape {
            replicas: 3,
            workers: 2,
            model: Model::Scripted {
                model: assets.model.clone(),
                token_ms: 20,
            },
            tokenizer: assets.tokenizer.clone(),
            orphan_after_secs: 2,
            logs: out.clone(),
        },
        clients: 6,
        plan: Plan {
            turns: 4,
            tokens: 200,
            turn_deadline: Duration::from_secs(60),
        },
        storm: Storm {
            every: Duration::from_millis(1500),
            redis_restart_at: Some(2),
            pg_restart_at: Some(6),
        },
        seed,
    })
    .await;
    println!("{report}");
    let v = &report.verdict;
    assert_eq!(v.turns, 24);
    assert!(v.faults >= 10, "{report}");
    let restarts = ["restart Redis", "restart PostgreSQL"];
    for r in restarts {
        assert!(report.faults.iter().any(|f| f.what == r), "{report}");
    }
    assert!(
        v.clean(Duration::from_secs(30)),
        "{report}\nthe processes' logs are in {}",
        out.display()
    );
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&assets.dir);
}
