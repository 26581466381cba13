//! Unmodified client libraries driven against a stack: a Python script that uses one, run with
//! the server's address and a key, whose last line of output is JSON.

use serde_json::Value;

/// Runs `script` (Python, which imports `package`) with `BASE_URL` and `API_KEY` in its
/// environment, and returns the JSON it prints. Panics, with the script's output, when it
/// fails, and with how to install it when `package` is missing.
pub async fn run_python(package: &str, script: &str, base_url: &str, key: &str) -> Value {
    let probe = std::process::Command::new("python3")
        .args(["-c", &format!("import {package}")])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "this test needs the `{package}` Python package: `python3 -m pip install {package}`"
    );
    let out = tokio::process::Command::new("python3")
        .args(["-c", script])
        .env("BASE_URL", base_url)
        .env("API_KEY", key)
        .env("NO_PROXY", "*")
        .output()
        .await
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("the script's output is JSON")
}
