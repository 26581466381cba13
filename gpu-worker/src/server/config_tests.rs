use super::*;

#[test]
fn sizes_parse_with_units_and_bad_ones_are_named() {
    assert_eq!(parse_bytes("1024"), Ok(1024));
    assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
    assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
    assert_eq!(parse_bytes("2gi"), Ok(2 << 30));
    assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
    assert_eq!(parse_bytes("64k"), Ok(64_000));
    for bad in ["", "lots", "12XB", "1e999GiB", "-5"] {
        let err = parse_bytes(bad).expect_err(bad);
        assert!(err.contains(&format!("`{bad}`")), "{err}");
    }
}

fn validate(args: &[&str]) -> Result<ValidConfig, ConfigError> {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }
    let argv = ["hearth-worker", "--scripted-token-ms", "1"];
    let cli = <Cli as clap::Parser>::try_parse_from(argv.iter().chain(args)).unwrap();
    cli.serve.validate()
}

#[test]
fn a_network_address_needs_a_worker_token() {
    let open = validate(&["--listen", "0.0.0.0:0"]).expect_err("no token");
    assert!(
        open.to_string()
            .starts_with("--listen: refusing to serve gRPC on 0.0.0.0:0"),
        "{open}"
    );
    let short = validate(&["--listen", "0.0.0.0:0", "--worker-token", "abc"]);
    assert!(short
        .expect_err("short")
        .to_string()
        .starts_with("--worker-token:"));
    let token = "0123456789abcdef0123456789abcdef";
    let c = validate(&["--listen", "0.0.0.0:0", "--worker-token", token]).expect("token");
    assert_eq!(c.token.as_ref().map(|t| t.expose()), Some(token));
    assert!(
        !format!("{c:?}").contains(token),
        "the token is never printed"
    );
    assert!(validate(&[]).expect("loopback").token.is_none());
}

#[test]
fn the_kv_budget_defaults_on_the_cpu_and_gpu_flags_are_checked() {
    let c = validate(&[]).unwrap();
    assert_eq!(
        (c.engine.kv_budget_bytes, c.kv_budget_given),
        (2 << 30, false)
    );
    assert_eq!(
        (c.run_on.forward, c.gpu_memory_fraction),
        (ForwardPass::Auto, 0.8)
    );
    let c = validate(&["--kv-budget", "1GiB", "--forward", "candle"]).unwrap();
    assert_eq!(
        (c.engine.kv_budget_bytes, c.kv_budget_given),
        (1 << 30, true)
    );
    assert_eq!(c.run_on.forward, ForwardPass::Candle);
    for bad in ["0", "1.5", "NaN"] {
        let err = validate(&["--gpu-memory-fraction", bad])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--gpu-memory-fraction:"), "{bad}: {err}");
    }
    let err = validate(&["--device", "cuda:1", "--forward", "kernels"]).unwrap_err();
    assert!(
        err.to_string().contains("`kernels` runs on the CPU only"),
        "{err}"
    );
    let err = validate(&["--kv-budget", "0"]).unwrap_err();
    assert!(err.to_string().starts_with("--kv-budget:"), "{err}");
    for flags in [["--forward", "candle"], ["--device", "cuda:0"]] {
        let err = validate(&[flags[0], flags[1], "--kv-dtype", "int8"]).unwrap_err();
        assert!(
            err.to_string().starts_with("--kv-dtype:"),
            "{flags:?}: {err}"
        );
    }
    assert!(validate(&["--forward", "candle", "--kv-dtype", "f16"]).is_ok());
    for (flags, says) in [
        (&["--dense-gemm-tokens", "0"][..], "at least 1"),
        (
            &["--forward", "kernels", "--dense-gemm-tokens", "64"][..],
            "candle forward pass",
        ),
    ] {
        let err = validate(flags).unwrap_err().to_string();
        assert!(
            err.starts_with("--dense-gemm-tokens:") && err.contains(says),
            "{flags:?}: {err}"
        );
    }
    let c = validate(&["--forward", "candle", "--dense-gemm-tokens", "64"]).unwrap();
    let cpu = crate::device::select(DeviceSpec::Cpu).unwrap();
    let options = c.run_on.generic_options(&cpu);
    assert_eq!(options.dense_gemm_tokens, Some(64));
    // CUDA graphs are on by default, for GPUs only; `--cuda-graphs false` turns them off.
    assert!(c.run_on.cuda_graphs && !options.step_graphs);
    let off = validate(&["--forward", "candle", "--cuda-graphs", "false"]).unwrap();
    assert!(!off.run_on.cuda_graphs);
}

#[test]
fn the_kernels_flag_names_kernels_this_cpu_runs() {
    use crate::kernels::{detect_isa, pick, KernelChoice as K};
    let c = validate(&[]).unwrap();
    assert_eq!(c.run_on.kernels, K::Auto);
    let c = validate(&["--kernels", "scalar"]).unwrap();
    assert_eq!(c.run_on.kernels, K::Scalar);
    for (flag, choice) in [("amx", K::Amx), ("vnni", K::Vnni), ("avx2", K::Avx2)] {
        let got = validate(&["--kernels", flag]);
        match pick(choice, detect_isa()) {
            Ok(_) => assert_eq!(got.unwrap().run_on.kernels, choice),
            Err(why) => {
                let err = got.unwrap_err().to_string();
                assert_eq!(err, format!("--kernels: {why}"));
            }
        }
    }
}

#[test]
fn the_window_margin_is_a_count_or_off() {
    assert_eq!(parse_margin("512"), Ok(WindowMargin(Some(512))));
    assert_eq!(parse_margin("off"), Ok(WindowMargin(None)));
    let err = parse_margin("-1").unwrap_err();
    assert!(err.contains("`-1`") && err.contains("`off`"), "{err}");
}
