use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn config(args: &[&str]) -> Result<Config, ConfigError> {
    let cli = Cli::try_parse_from(std::iter::once("hearth").chain(args.iter().copied()))
        .expect("the arguments parse");
    Config::from_args(cli.serve)
}

#[test]
fn shared_prompts_are_read_and_bad_ones_named() {
    let dir = std::env::temp_dir().join(format!("hearth-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (good, empty) = (dir.join("support.txt"), dir.join("empty.txt"));
    std::fs::write(&good, "You are the support desk of the harbour.").expect("write");
    std::fs::write(&empty, " \n").expect("write");
    let arg = |name: &str, p: &std::path::Path| format!("{name}={}", p.display());
    let c = config(&["--shared-prompt", &arg("support", &good)]).expect("ok");
    assert_eq!(c.shared_prompts.len(), 1);
    assert_eq!(c.shared_prompts[0].name, "support");
    assert!(c.shared_prompts[0].text.contains("harbour"));
    let twice = format!("{},{}", arg("a", &good), arg("a", &good));
    for (bad, why) in [
        ("no-equals-sign".to_string(), "NAME=FILE"),
        (arg("bad name", &good), "letters"),
        (twice, "twice"),
        (arg("e", &empty), "empty"),
        (arg("m", &dir.join("missing.txt")), "cannot read"),
    ] {
        let e = config(&["--shared-prompt", &bad]).expect_err(&bad);
        assert_eq!(e.flag, "--shared-prompt");
        assert!(e.reason.contains(why), "{bad}: {}", e.reason);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_defaults_make_a_local_quick_start() {
    let c = config(&["--models-dir", "/m"]).expect("defaults are valid");
    assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.tokenizer, PathBuf::from("/m/gemma-3-tokenizer.json"));
    let Workers::Local(w) = &c.workers else {
        panic!("no --worker starts a local one: {:?}", c.workers);
    };
    assert_eq!(w.models_dir, PathBuf::from("/m"));
    assert_eq!(c.pool.batch.max_batch, 32);
    assert_eq!(c.limits.max_messages_per_session, 10_000);
    assert_eq!(c.api.body_timeout, Duration::from_secs(30));
    assert!(c.http.max_connections >= 1);
    let c = config(&["--worker", "w0:50051,w1:50051", "--tokenizer", "/t.json"]).expect("ok");
    assert_eq!(
        c.workers,
        Workers::Remote {
            addrs: vec!["w0:50051".into(), "w1:50051".into()],
            dns: None
        }
    );
    assert_eq!(c.tokenizer, PathBuf::from("/t.json"));
}

#[test]
fn a_dns_worker_that_cannot_be_looked_up_is_refused_by_its_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--worker", "dns:"],
            "--worker dns:: expected dns:NAME:PORT",
        ),
        (
            &["--worker", "dns::50051"],
            "--worker dns::50051: no name to look up (dns:NAME:PORT)",
        ),
        (
            &["--worker", "dns:workers:http"],
            "--worker dns:workers:http: the port must be a number from 1 to 65535 \
             (dns:NAME:PORT)",
        ),
        (
            &["--worker", "dns:workers:0"],
            "--worker dns:workers:0: the port must be a number from 1 to 65535 \
             (dns:NAME:PORT)",
        ),
        (
            &["--worker", "dns:workers:1", "--dns-refresh-secs", "0"],
            "--dns-refresh-secs 0: must be at least 1",
        ),
        (
            &["--worker", "w0:1", "--dns-server", "127.0.0.1:53"],
            "--dns-server 127.0.0.1:53: is only asked for --worker dns:NAME:PORT workers, \
             and there are none",
        ),
    ];
    for (args, want) in cases {
        let e = config(args).expect_err(want);
        assert_eq!(e.to_string(), *want, "{args:?}");
    }
}

#[test]
fn dns_workers_mix_with_fixed_ones_and_carry_their_refresh() {
    let c = config(&[
        "--worker",
        "w0:50051,dns:workers.hearth.svc.cluster.local.:50051",
        "--worker",
        "dns:more.test:7",
        "--dns-refresh-secs",
        "3",
        "--dns-server",
        "127.0.0.1:5353",
    ])
    .expect("ok");
    let name = |n: &str, port| DnsWorkers {
        name: n.to_string(),
        port,
    };
    let want = Workers::Remote {
        addrs: vec!["w0:50051".into()],
        dns: Some(Discovery {
            names: vec![
                name("workers.hearth.svc.cluster.local.", 50051),
                name("more.test", 7),
            ],
            refresh: Duration::from_secs(3),
            server: Some("127.0.0.1:5353".parse().expect("addr")),
        }),
    };
    assert_eq!(c.workers, want);
    let Workers::Remote { dns: Some(d), .. } =
        config(&["--worker", "dns:w.test:1"]).expect("ok").workers
    else {
        panic!("a dns: worker is remote");
    };
    assert_eq!((d.refresh, d.server), (Duration::from_secs(10), None));
}

#[test]
fn a_value_that_cannot_be_served_with_is_refused_by_its_flag() {
    let least = [
        ("--batch-size", 0, 1),
        ("--health-interval-ms", 5, 10),
        ("--stall-timeout-secs", 0, 1),
        ("--default-max-tokens", 0, 1),
        ("--max-messages-per-session", 1, 2),
        ("--max-sessions-per-user", 0, 1),
        ("--body-timeout-secs", 0, 1),
        ("--header-timeout-secs", 0, 1),
        ("--max-connections", 0, 1),
        ("--orphan-after-secs", 0, 1),
    ];
    for (flag, value, min) in least {
        let e = config(&[flag, &value.to_string()]).expect_err(flag);
        assert_eq!(
            e.to_string(),
            format!("{flag} {value}: must be at least {min}")
        );
    }
    let cases: &[(&[&str], &str)] = &[
        (
            &["--worker", "http://w0:50051"],
            "--worker http://w0:50051: give the worker as host:port, without a scheme",
        ),
        (
            &["--worker", "w0"],
            "--worker w0: a worker address needs a port (host:port)",
        ),
        (
            &["--worker", "w0:50051,"],
            "--worker : a worker address must not be empty",
        ),
    ];
    for (args, want) in cases {
        let e = config(args).expect_err(want);
        assert_eq!(e.to_string(), *want, "{args:?}");
    }
    let e = config(&["--listen", "0.0.0.0:8080"]).expect_err("open without auth");
    assert_eq!(e.flag, "--listen");
    assert!(e.reason.contains("--auth keys"), "{e}");
    assert!(config(&["--listen", "0.0.0.0:8080", "--auth", "keys"]).is_ok());
    let e = config(&["--redis-url", "http://:hunter2@cache:6379"]).expect_err("not redis");
    assert_eq!(e.flag, "--redis-url");
    assert!(!e.to_string().contains("hunter2"), "{e}");
}
