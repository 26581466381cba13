//! The API against its OpenAPI document, checked by a property-based fuzzer that Hearth's
//! authors did not write: Schemathesis (PyPI) generates requests from `/openapi.json`, valid
//! and invalid, including sequences that follow the document's links (create a session, then
//! post to it, stop it, delete it), and checks that every answer has a documented status and
//! content type, a body that matches its schema, and is never a 5xx.

use std::process::Stdio;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{Db, Stack};

/// The committed document, which the web UI's types are generated from.
const COMMITTED: &str = include_str!("../../orchestrator/openapi.json");

/// Every check but one: answers are never 5xx, have documented statuses, content types,
/// headers and bodies; data the document forbids is refused; deleted sessions stay gone; auth is
/// not ignored; undocumented methods get 405. Left out: `positive_data_acceptance` (data the
/// document allows is accepted), because some limits depend on the served model and on stored
/// state, which a static document cannot state: `max_tokens` must be below the model's context,
/// a message must not be blank, a regenerate needs a reply to replace.
const EXCLUDED: &str = "positive_data_acceptance";

#[tokio::test]
async fn every_answer_to_generated_requests_is_documented_and_matches_its_schema() {
    let s = Stack::start("contract", Db::Postgres, 1, &[]).await;
    let key = s.key("fuzz").await;

    let r = Req::new("GET", "/openapi.json").send(s.addr()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.text().trim_end(),
        COMMITTED.trim_end(),
        "the served document differs from orchestrator/openapi.json: run `make openapi`"
    );

    let report = s.assets.dir.join("schemathesis");
    let out = tokio::process::Command::new("schemathesis")
        .args(["run", &format!("http://{}/openapi.json", s.addr())])
        .args(["--header", &format!("Authorization: Bearer {key}")])
        .args(["--checks", "all", "--exclude-checks", EXCLUDED])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        // One worker: Hypothesis describes strategies through a cache that threads can race on.
        .args(["--max-examples", "40", "--seed", "1", "--workers", "1"])
        .args(["--request-timeout", "30"])
        .args(["--suppress-health-check", "too_slow,filter_too_much"])
        .arg("--continue-on-failure")
        .arg("--report-dir")
        .arg(&report)
        // Its own files (a cache of examples) go with the test's, not into the checkout.
        .current_dir(&s.assets.dir)
        .env("NO_COLOR", "1")
        .env("SCHEMATHESIS_TELEMETRY", "false")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run schemathesis (pip install schemathesis; .ci/run installs it)");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success(),
        "schemathesis found answers outside the document (above)"
    );
    // It really exercised the API: every operation, over a thousand cases, and the sequences
    // that follow links from a created session.
    assert!(
        text.contains("Tested: 28"),
        "not every operation was tested"
    );
    let generated: u32 = text
        .lines()
        .find(|l| l.contains(" generated, "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    assert!(generated >= 1000, "only {generated} cases were generated");
    assert!(
        text.contains("✅ Stateful"),
        "the linked sequences did not run"
    );
    s.finish().await;
}
