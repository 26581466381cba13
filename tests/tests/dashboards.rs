//! deploy/'s Grafana dashboards and Prometheus rules against a real Prometheus scraping a real
//! stack (the `hearth` binary, two `hearth-worker` processes with a tiny model, PostgreSQL)
//! after a short mixed load: every panel's expression must parse and return data, every rule
//! must load and evaluate, and each alert's condition must hold exactly where it should: on the
//! healthy stack after the load, and once a worker is killed. A metric renamed in the code, or a
//! panel with a typo, fails here with the panel's name. Grafana itself cannot be installed here;
//! its provisioning files are checked for shape.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::prometheus::{Job, Prometheus};
use hearth_e2e::stack::{Db, Stack};
use serde_json::{json, Value};

/// How often the test's Prometheus scrapes and evaluates rules.
const SCRAPE: Duration = Duration::from_secs(1);
/// What `$__rate_interval` becomes: the whole load fits in it, and it holds many scrapes.
const RATE_INTERVAL: &str = "1m";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn dashboards() -> Vec<(String, Value)> {
    let dir = deploy_dir().join("grafana/dashboards");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let v: Value = serde_json::from_str(&read(&p))
                .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every panel, rows' nested panels included.
fn panels(dash: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().into_iter().flatten() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten().cloned());
        } else {
            out.push(p.clone());
        }
    }
    out
}

/// Problems with a dashboard's shape, as Grafana's file provisioning would load it.
fn shape_problems(name: &str, dash: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    for key in ["uid", "title"] {
        if dash[key].as_str().is_none_or(str::is_empty) {
            bad.push(format!("{name}: no {key}"));
        }
    }
    let vars: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
        .collect();
    if !vars.contains(&"datasource") {
        bad.push(format!("{name}: no $datasource variable"));
    }
    let all = panels(dash);
    if all.is_empty() {
        bad.push(format!("{name}: no panels"));
    }
    for p in &all {
        let title = p["title"].as_str().unwrap_or("(untitled)");
        if p["gridPos"]["w"].as_u64().is_none() || p["gridPos"]["h"].as_u64().is_none() {
            bad.push(format!("{name} / {title}: no gridPos"));
        }
        if p["datasource"]["uid"] != "${datasource}" {
            bad.push(format!("{name} / {title}: datasource is not $datasource"));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            bad.push(format!("{name} / {title}: no targets"));
        }
        for t in &targets {
            if t["expr"].as_str().is_none_or(str::is_empty) || t["refId"].as_str().is_none() {
                bad.push(format!("{name} / {title}: a target without expr or refId"));
            }
            if p["type"] == "heatmap" && t["format"] != "heatmap" {
                bad.push(format!(
                    "{name} / {title}: heatmap target not in heatmap format"
                ));
            }
        }
    }
    bad
}

/// The provisioning files point Grafana at the Prometheus service and the dashboards directory
/// that docker-compose mounts, under the uid the dashboards' `$datasource` defaults to.
#[test]
fn grafana_provisioning_matches_the_compose_mounts() {
    let d = deploy_dir();
    let compose = read(&d.join("docker-compose.yml"));
    let datasource = read(&d.join("grafana/provisioning/datasources/prometheus.yml"));
    let provider = read(&d.join("grafana/provisioning/dashboards/hearth.yml"));
    assert!(compose.contains("./grafana/provisioning:/etc/grafana/provisioning"));
    assert!(compose.contains("./grafana/dashboards:/var/lib/grafana/dashboards"));
    assert!(
        provider.contains("path: /var/lib/grafana/dashboards"),
        "{provider}"
    );
    assert!(provider.contains("type: file"), "{provider}");
    assert!(datasource.contains("type: prometheus"), "{datasource}");
    assert!(
        datasource.contains("url: http://prometheus:9090"),
        "{datasource}"
    );
    assert!(datasource.contains("uid: prometheus"), "{datasource}");
    let mut uids = Vec::new();
    let mut problems = Vec::new();
    for (name, dash) in dashboards() {
        problems.extend(shape_problems(&name, &dash));
        let ds_default = dash["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == "datasource")
            .map(|v| v["current"]["value"].clone());
        if ds_default != Some(json!("prometheus")) {
            problems.push(format!(
                "{name}: $datasource does not default to uid prometheus"
            ));
        }
        uids.push(dash["uid"].as_str().unwrap_or_default().to_string());
    }
    assert!(
        uids.len() >= 2,
        "expected the overview and the per-worker dashboards"
    );
    let mut unique = uids.clone();
    unique.dedup();
    assert_eq!(uids.len(), unique.len(), "dashboard uids repeat: {uids:?}");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A regex matching any of `values` (as Grafana writes a multi-value variable).
fn regex_of(values: &[String]) -> String {
    let escaped: Vec<String> = values
        .iter()
        .map(|v| {
            v.chars()
                .flat_map(|c| {
                    if ".+*?()|[]{}^$\\".contains(c) {
                        vec!['\\', '\\', c]
                    } else {
                        vec![c]
                    }
                })
                .collect()
        })
        .collect();
    format!("({})", escaped.join("|"))
}

/// Each query variable's values, from `label_values(metric, label)` on the live Prometheus.
async fn variables(prom: &Prometheus, dash: &Value, name: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    out.insert("__rate_interval".to_string(), RATE_INTERVAL.to_string());
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let var = v["name"].as_str().unwrap_or_default();
        let query = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default();
        let args = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| {
                panic!("{name}: ${var}: only label_values(metric, label) is handled, got `{query}`")
            });
        let (metric, label) = args
            .split_once(',')
            .unwrap_or_else(|| panic!("{name}: ${var}: `{query}` names no label"));
        let values = prom
            .label_values(metric.trim(), label.trim())
            .await
            .unwrap_or_else(|e| panic!("{name}: ${var}: {e}"));
        assert!(
            !values.is_empty(),
            "{name}: variable ${var} (`{query}`) has no values: its metric or label is wrong"
        );
        out.insert(var.to_string(), regex_of(&values));
    }
    out
}

/// `expr` with Grafana's variables replaced; an unknown variable is an error.
fn substitute(expr: &str, vars: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = expr.to_string();
    // Longest names first, so `$instance` never eats part of `$instance_x`.
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for n in names {
        out = out
            .replace(&format!("${{{n}}}"), &vars[n])
            .replace(&format!("${n}"), &vars[n]);
    }
    match out.find('$') {
        Some(i) => Err(format!("unknown variable at `{}`", &out[i..])),
        None => Ok(out),
    }
}

/// Whether a query result holds at least one series with a number (not NaN) as its value.
fn has_number(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| !v.is_nan())
    })
}

/// A short load that touches every metric the dashboards show: native multi-turn sessions
/// (session cache), stateless completions, replies cut by length, rate-limited requests, and
/// client errors of several types. Run in two rounds a few scrapes apart: a histogram or
/// labelled counter first appears with the first event, and `rate()` needs an increase
/// between two scrapes of a series that already exists.
async fn load(s: &Stack, round: usize) {
    let key = s.key(&format!("dashboards-{round}")).await;
    let limited = s
        .limited_key(&format!("dashboards-limited-{round}"), 1)
        .await;
    let addr = s.addr();
    for i in 0..3 {
        let r = Req::new("POST", "/v1/sessions")
            .key(Some(&key))
            .json(&json!({"title": format!("s{i}")}))
            .send(addr)
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let sid = r.json()["id"].as_str().expect("session id").to_string();
        for turn in 0..2 {
            let events = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
                .key(Some(&key))
                .json(&json!({"content": format!("turn {turn} of session {i}: hello there"), "max_tokens": 12}))
                .events(addr)
                .await
                .rest()
                .await;
            let last = events.last().expect("events");
            assert_eq!(last.event, "message_end", "{events:?}");
        }
    }
    for i in 0..3 {
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&key))
            .json(&json!({"model": "tiny", "max_tokens": 6 + i, "messages": [{"role": "user", "content": "count to ten"}]}))
            .send(addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // A second request in the minute on a one-a-minute key: 429.
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&limited))
            .json(&json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}))
            .send(addr)
            .await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, [200, 429]);
    // Client errors: an unknown route, a missing key, a parameter that cannot be honoured.
    assert_eq!(
        Req::new("GET", "/v1/nope")
            .key(Some(&key))
            .send(addr)
            .await
            .status,
        404
    );
    assert_eq!(Req::new("GET", "/v1/sessions").send(addr).await.status, 401);
    let bad = Req::new("POST", "/v1/chat/completions")
        .key(Some(&key))
        .json(&json!({"model": "tiny", "n": 17, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}))
        .send(addr)
        .await;
    assert_eq!(bad.status, 422, "{}", bad.text());
}

/// Waits until every rule has been evaluated (health `ok`) or one reports an error.
async fn rules_after_evaluation(prom: &Prometheus) -> Vec<Value> {
    let mut rules = Vec::new();
    for _ in 0..100 {
        let data = prom.api("/api/v1/rules").await.expect("rules API");
        rules = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        if !rules.is_empty() && rules.iter().all(|r| r["health"] != "unknown") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rules
}

#[tokio::test]
async fn every_dashboard_panel_and_rule_returns_data_from_a_real_prometheus() {
    let mut s = Stack::start("dashboards", Db::Postgres, 2, &[]).await;
    let rules_file = deploy_dir().join("prometheus/rules/hearth.yml");
    let jobs = [
        Job {
            name: "hearth".into(),
            targets: vec![s.addr().to_string()],
        },
        Job {
            name: "hearth-worker".into(),
            targets: s.workers.iter().map(|w| w.metrics.clone()).collect(),
        },
    ];
    let prom = Prometheus::start(&jobs, &[rules_file.as_path()], SCRAPE).await;

    // The load must come after the first scrape of every target, or Prometheus never sees
    // the counters move.
    let mut up = Vec::new();
    for _ in 0..200 {
        up = prom.query("up == 1").await.expect("up");
        if up.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        up.len(),
        3,
        "not every target is up: {up:?}\n{}",
        prom.log()
    );
    load(&s, 1).await;
    tokio::time::sleep(SCRAPE * 3).await;
    load(&s, 2).await;
    // Let every target be scraped several times after the load.
    tokio::time::sleep(SCRAPE * 4).await;

    let mut empty = Vec::new();
    let mut checked = 0;
    for (name, dash) in dashboards() {
        let vars = variables(&prom, &dash, &name).await;
        for p in panels(&dash) {
            let title = p["title"].as_str().unwrap_or("(untitled)").to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                let raw = t["expr"].as_str().unwrap_or_default();
                let legend = t["legendFormat"].as_str().unwrap_or_default();
                let what = format!("{name} / panel \"{title}\" / {legend}");
                let expr = match substitute(raw, &vars) {
                    Ok(e) => e,
                    Err(e) => {
                        empty.push(format!("{what}: {e} in `{raw}`"));
                        continue;
                    }
                };
                checked += 1;
                match prom.query(&expr).await {
                    Err(e) => empty.push(format!("{what}: does not evaluate: {e}\n    {expr}")),
                    Ok(r) if r.is_empty() => empty.push(format!("{what}: no series\n    {expr}")),
                    Ok(r) if !has_number(&r) => {
                        empty.push(format!("{what}: only NaN values\n    {expr}"))
                    }
                    Ok(_) => {}
                }
            }
        }
    }
    assert!(checked >= 60, "only {checked} panel expressions found");

    let rules = rules_after_evaluation(&prom).await;
    let declared = read(&rules_file)
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("- alert:") || l.starts_with("- record:")
        })
        .count();
    assert_eq!(
        rules.len(),
        declared,
        "Prometheus loaded {} of {declared} rules",
        rules.len()
    );
    let mut broken = Vec::new();
    for r in &rules {
        let name = r["name"].as_str().unwrap_or_default();
        let query = r["query"].as_str().unwrap_or_default();
        if r["health"] != "ok" {
            broken.push(format!(
                "rule {name}: health {} {}",
                r["health"], r["lastError"]
            ));
        }
        if let Err(e) = prom.query(query).await {
            broken.push(format!("rule {name}: does not evaluate: {e}\n    {query}"));
        }
    }
    // Which alerts' conditions hold, evaluated directly: Prometheus's own ALERTS series cannot
    // show it here, since every alert waits `for:` a minute or more and this test lasts seconds
    // (deploy/prometheus/tests, run by promtool, cover each alert firing and resolving).
    let alerts: Vec<(String, String)> = rules
        .iter()
        .filter(|r| r["type"] == "alerting")
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (field("name"), field("query"))
        })
        .collect();
    assert!(alerts.len() >= 5, "only {} alerts loaded", alerts.len());
    // On the healthy stack after the load (its 4xx answers and one 429 included), none.
    let healthy = holding(&prom, &alerts).await;

    // A worker dies: once Prometheus fails to scrape it, HearthWorkerDown's condition holds, and
    // the one worker left keeps HearthNoReadyWorker's from holding.
    s.workers[1].child.kill().expect("kill a worker");
    s.workers[1].child.wait().expect("the killed worker");
    let mut down = BTreeSet::new();
    for _ in 0..600 {
        down = holding(&prom, &alerts).await;
        if down.contains("HearthWorkerDown") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    s.finish().await;
    assert!(broken.is_empty(), "{}", broken.join("\n"));
    assert!(
        empty.is_empty(),
        "{} of {checked} panel expressions return no data:\n{}",
        empty.len(),
        empty.join("\n")
    );
    assert_eq!(
        healthy,
        BTreeSet::new(),
        "alert conditions that hold on the healthy stack after the load"
    );
    assert_eq!(
        down,
        BTreeSet::from(["HearthWorkerDown".to_string()]),
        "alert conditions that hold once a worker is killed (60 s allowed)"
    );
}

/// The alerts (name, expression) whose expression returns a series now: those whose condition
/// holds, whether or not they have held for their `for:` yet.
async fn holding(prom: &Prometheus, alerts: &[(String, String)]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (name, expr) in alerts {
        let now = prom
            .query(expr)
            .await
            .unwrap_or_else(|e| panic!("alert {name}: does not evaluate: {e}\n    {expr}"));
        if !now.is_empty() {
            names.insert(name.clone());
        }
    }
    names
}
