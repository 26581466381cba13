use super::*;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

/// Deterministic pseudo-random values in [-1, 1).
pub(crate) fn noise(n: usize, seed: u64) -> Vec<f32> {
    crate::fixtures::noise(n, seed, 1.0)
}

/// Whether this CPU runs the `path` under test, reported either way for the running test (the
/// harness names its thread after it): a path that runs is printed with the test's output; one
/// that cannot, with the CPU features it lacks (`missing`), is written straight to stderr, past
/// the harness's capture, so a test that passes without it never passes silently.
pub(crate) fn cpu_runs(path: &str, missing: &[&str]) -> bool {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("(unnamed test)");
    if missing.is_empty() {
        println!("{test}: {path} path tested");
        return true;
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "{test}: {path} path SKIPPED (cpu lacks {})",
        missing.join(", ")
    );
    false
}

/// The CPU features in `wanted` (name, present) that are absent.
pub(crate) fn lacking<'a>(wanted: &[(&'a str, bool)]) -> Vec<&'a str> {
    wanted
        .iter()
        .filter(|(_, has)| !has)
        .map(|(n, _)| *n)
        .collect()
}

/// Every kernel path this CPU can run; each one it cannot is reported by [`cpu_runs`].
fn all_isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    cpu_runs("scalar", &[]);
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
        ];
        if cpu_runs("AVX2", &lacking(&avx2)) {
            v.push(Isa::Avx2);
        }
        // What `detect_isa` asks before it picks the VNNI kernels.
        let vnni = [
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
            ("avx512vl", is_x86_feature_detected!("avx512vl")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
        ];
        if cpu_runs("AVX-512 VNNI", &lacking(&vnni)) {
            assert!(detect_isa().has_vnni(), "the features detect_isa asks");
            v.push(Isa::Avx512Vnni);
            let why = format!("AMX tile state ({})", amx());
            let amx_missing = if *amx() == Amx::Granted {
                vec![]
            } else {
                vec![why.as_str()]
            };
            if cpu_runs("AMX", &amx_missing) {
                assert_eq!(detect_isa(), Isa::Amx, "the best where AMX is granted");
                v.push(Isa::Amx);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for path in ["AVX2", "AVX-512 VNNI"] {
        cpu_runs(path, &["x86_64"]);
    }
    v
}

/// candle's own quantized matmul on the same GGUF bytes is the reference.
fn candle_reference(
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    m: usize,
    seed: u64,
) -> (Q8Matrix, Vec<f32>, Vec<f32>) {
    let dev = Device::Cpu;
    let w = Tensor::from_vec(noise(rows * cols, seed), (rows, cols), &dev).unwrap();
    let qt = QTensor::quantize(&w, dtype).unwrap();
    let bytes = qt.data().unwrap();
    let ours = match dtype {
        GgmlDType::Q8_0 => Q8Matrix::from_q8_0(rows, cols, &bytes).unwrap(),
        GgmlDType::Q5_0 => Q8Matrix::from_q5_0(rows, cols, &bytes).unwrap(),
        _ => unreachable!(),
    };
    let x = noise(m * cols, seed + 1);
    let xt = Tensor::from_vec(x.clone(), (m, cols), &dev).unwrap();
    let want = QMatMul::from_qtensor(qt).unwrap().forward(&xt).unwrap();
    (ours, x, want.flatten_all().unwrap().to_vec1().unwrap())
}

#[test]
fn every_isa_matches_candle_for_q8_0_and_q5_0() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q5_0] {
        // Odd sizes exercise the remainder paths (rows not a multiple of 4, batch not of 4).
        for (rows, cols, m) in [(64, 64, 1), (70, 128, 3), (131, 640, 9), (256, 640, 16)] {
            let (w, x, want) = candle_reference(dtype, rows, cols, m, rows as u64);
            let xq = quantize_activations(&x, m, cols);
            // GGUF's scales are f16, so both layouts hold the file's matrix exactly.
            let panels = to_panels(&w).expect("GGUF scales are f16 values");
            for (isa, w) in all_isas().into_iter().flat_map(|i| [(i, &w), (i, &panels)]) {
                let mut got = vec![0f32; m * rows];
                matmul_q8_with(isa, w, &xq, &mut got);
                let layout = w.layout;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    // candle rounds activation scales to f16, we keep f32: allow that difference.
                    let tol = 1e-2 * (1.0 + w.abs());
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype:?} {isa:?} {layout:?} {rows}x{cols} m={m} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// A matrix's layout and bytes, to compare two conversions of it.
fn parts(m: &Q8Matrix) -> (Layout, usize, usize, Vec<i8>, Vec<f32>, Vec<half::f16>) {
    (
        m.layout,
        m.rows,
        m.cols,
        m.qs.to_vec(),
        m.scales.clone(),
        m.half_scales.clone(),
    )
}

#[test]
fn blocks_go_straight_into_panels_as_through_the_row_layout() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q5_0] {
        // Rows not a multiple of the panel (a padded last panel), and a -128 in a Q8_0 block.
        for (rows, cols) in [(1, 32), (17, 64), (70, 640)] {
            let t = Tensor::from_vec(noise(rows * cols, 5), (rows, cols), &Device::Cpu).unwrap();
            let mut bytes = QTensor::quantize(&t, dtype)
                .unwrap()
                .data()
                .unwrap()
                .to_vec();
            if dtype == GgmlDType::Q8_0 {
                bytes[2] = 0x80;
            }
            let rows_layout = match dtype {
                GgmlDType::Q8_0 => Q8Matrix::from_q8_0(rows, cols, &bytes).unwrap(),
                _ => Q8Matrix::from_q5_0(rows, cols, &bytes).unwrap(),
            };
            let (block, decode) = match dtype {
                GgmlDType::Q8_0 => (q8::Q8_0_BYTES, q8::q8_0_block as q8::Decode),
                _ => (q8::Q5_0_BYTES, q8::q5_0_block as q8::Decode),
            };
            // Every CPU: the direct panels equal the row layout's panels.
            let direct = panels::panels_from_blocks(rows, cols, &bytes, block, decode);
            let through = to_panels(&rows_layout).expect("f16 scales");
            assert_eq!(parts(&direct), parts(&through), "{dtype:?} {rows}x{cols}");
            // This CPU: the loader's conversion equals the conversion it replaces.
            let got = blocks_for_this_cpu(dtype, rows, cols, &bytes)
                .unwrap()
                .unwrap();
            let old = for_this_cpu(rows_layout);
            let old = to_five_bit(&old).unwrap_or(old);
            assert_eq!(
                parts(&got),
                parts(&old),
                "{dtype:?} {rows}x{cols} on {:?}",
                cached_isa()
            );
        }
    }
    assert!(blocks_for_this_cpu(GgmlDType::Q8_0, 2, 32, &[0u8; 67])
        .unwrap()
        .is_err());
    assert!(blocks_for_this_cpu(GgmlDType::F32, 1, 32, &[0u8; 128]).is_none());
}

#[test]
fn batch_rows_are_independent() {
    // Row 2 of a batch equals the same activation computed alone.
    let (rows, cols) = (40, 64);
    let w = Q8Matrix::quantize(rows, cols, &noise(rows * cols, 3));
    let x = noise(5 * cols, 4);
    let mut batch = vec![0f32; 5 * rows];
    matmul_q8(&w, &quantize_activations(&x, 5, cols), &mut batch);
    let mut alone = vec![0f32; rows];
    matmul_q8(
        &w,
        &quantize_activations(&x[2 * cols..3 * cols], 1, cols),
        &mut alone,
    );
    assert_eq!(&batch[2 * rows..3 * rows], &alone[..]);
}

#[test]
fn q5_0_and_q8_0_dequantize_like_candle() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q5_0] {
        let (rows, cols) = (3, 64);
        let t = Tensor::from_vec(noise(rows * cols, 11), (rows, cols), &Device::Cpu).unwrap();
        let qt = QTensor::quantize(&t, dtype).unwrap();
        let want: Vec<f32> = qt
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = qt.data().unwrap();
        let m = match dtype {
            GgmlDType::Q8_0 => Q8Matrix::from_q8_0(rows, cols, &bytes).unwrap(),
            _ => Q8Matrix::from_q5_0(rows, cols, &bytes).unwrap(),
        };
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(
                &row[..],
                &want[r * cols..(r + 1) * cols],
                "{dtype:?} row {r}"
            );
        }
    }
}

#[test]
fn malformed_block_data_is_an_error_not_a_panic() {
    assert!(Q8Matrix::from_q8_0(2, 32, &[0u8; 67]).is_err());
    assert!(Q8Matrix::from_q5_0(1, 48, &[0u8; 33]).is_err());
}

#[test]
fn a_q8_0_value_of_minus_128_is_read_as_minus_127_on_every_path() {
    // GGUF's quantizer never writes -128, but a file may hold it; the AVX2 kernel cannot take it.
    let mut block = vec![0u8; 34];
    block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
    for (j, b) in block[2..].iter_mut().enumerate() {
        *b = if j % 2 == 0 { 0x80 } else { 100 };
    }
    let w = Q8Matrix::from_q8_0(1, 32, &block).unwrap();
    assert_eq!(w.qs[0], -127);
    let x = quantize_activations(&noise(32, 3), 1, 32);
    let want: f32 = (0..32)
        .map(|j| {
            let wv = if j % 2 == 0 { -127.0 } else { 100.0 };
            0.5 * wv * x.scales[0] * x.qs[j] as f32
        })
        .sum();
    for isa in all_isas() {
        let mut got = [0f32];
        matmul_q8_with(isa, &w, &x, &mut got);
        assert!(
            (got[0] - want).abs() <= 1e-4 * (1.0 + want.abs()),
            "{isa:?}: {} vs {want}",
            got[0]
        );
    }
}

#[test]
fn simd_paths_match_the_scalar_reference_including_odd_block_counts() {
    // 96 columns: an odd number of blocks exercises the AVX-512 path's single-block tail; 4096
    // columns and 37 rows make the AVX2 path take its activation rows in several cache blocks.
    for (rows, cols, m) in [
        (37, 128, 6),
        (19, 96, 5),
        (8, 32, 4),
        (5, 160, 1),
        (9, 4096, 37),
    ] {
        let w = Q8Matrix::quantize(rows, cols, &noise(rows * cols, 9));
        let x = quantize_activations(&noise(m * cols, 10), m, cols);
        let mut reference = vec![0f32; m * rows];
        matmul_q8_with(Isa::Scalar, &w, &x, &mut reference);
        for isa in all_isas() {
            let mut got = vec![0f32; m * rows];
            matmul_q8_with(isa, &w, &x, &mut got);
            for (g, r) in got.iter().zip(&reference) {
                assert!(
                    (g - r).abs() <= 1e-4 * (1.0 + r.abs()),
                    "{isa:?} {rows}x{cols}: {g} vs {r}"
                );
            }
        }
    }
}

#[test]
fn activations_quantized_across_the_pool_match_rows_quantized_alone() {
    // 300 × 640 values: enough to be split across the kernel pool's threads.
    let (rows, cols) = (300, 640);
    let x = noise(rows * cols, 5);
    let all = quantize_activations(&x, rows, cols);
    let bpr = cols / QK;
    for r in [0, 1, 149, 150, 151, 298, 299] {
        let one = quantize_activations(&x[r * cols..(r + 1) * cols], 1, cols);
        assert_eq!(&all.qs[r * cols..(r + 1) * cols], &one.qs[..], "row {r}");
        assert_eq!(
            &all.scales[r * bpr..(r + 1) * bpr],
            &one.scales[..],
            "row {r}"
        );
        assert_eq!(&all.sums[r * bpr..(r + 1) * bpr], &one.sums[..], "row {r}");
        let halves = &all.half_sums[r * bpr..(r + 1) * bpr];
        assert_eq!(halves, &one.half_sums[..], "row {r}");
        for (b, &h) in halves.iter().enumerate() {
            let first = &all.qs[r * cols + b * QK..][..QK / 2];
            assert_eq!(h, first.iter().map(|&v| v as i32).sum::<i32>(), "row {r}");
        }
    }
}

#[test]
fn the_panel_layout_gives_the_row_layout_s_products_and_rows() {
    // Rows that fill no panel, one panel, and a panel and a half; odd block counts; batches that
    // take the four-row tiles, the one-row tiles, and both.
    for (rows, cols, m) in [
        (5, 64, 1),
        (16, 96, 4),
        (40, 640, 9),
        (70, 128, 3),
        (131, 640, 16),
    ] {
        let w = Q8Matrix::quantize(rows, cols, &noise(rows * cols, 21));
        let p = to_panels(&w).expect("scales are f16 values");
        assert_eq!(p.layout, Layout::Panels);
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in [0, rows / 2, rows - 1] {
            w.dequantize_row(r, &mut a);
            p.dequantize_row(r, &mut b);
            assert_eq!(a, b, "row {r} of {rows}x{cols}");
        }
        let x = quantize_activations(&noise(m * cols, 22), m, cols);
        let mut reference = vec![0f32; m * rows];
        matmul_q8_with(Isa::Scalar, &w, &x, &mut reference);
        for isa in all_isas() {
            let mut got = vec![f32::NAN; m * rows];
            matmul_q8_with(isa, &p, &x, &mut got);
            for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                assert!(
                    (g - r).abs() <= 1e-4 * (1.0 + r.abs()),
                    "{isa:?} {rows}x{cols} batch {m}, cell {i}: {g} vs {r}"
                );
            }
        }
    }
}

#[test]
fn a_panel_row_s_result_does_not_depend_on_its_batch() {
    // The engine's bit-identity between batched, chunked and cached tokens rests on this. 29 rows
    // take the kernels' 16-, 8-, 4- and 1-row tiles; every panel format.
    let (rows, cols, n) = (100, 768, 29);
    let file = |dtype| {
        let w = Tensor::from_vec(noise(rows * cols, 23), (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec()
    };
    let eight = to_panels(&Q8Matrix::quantize(rows, cols, &noise(rows * cols, 23))).unwrap();
    let five = Q8Matrix::from_q5_0(rows, cols, &file(GgmlDType::Q5_0)).unwrap();
    let five = to_five_bit(&to_panels(&five).unwrap()).unwrap();
    let q4k = from_q4_k(rows, cols, &file(GgmlDType::Q4K)).unwrap();
    let q6k = from_q6_k(rows, cols, &file(GgmlDType::Q6K)).unwrap();
    let x = noise(n * cols, 24);
    for w in [eight, five, q4k, q6k] {
        for isa in all_isas() {
            let mut batch = vec![0f32; n * rows];
            matmul_q8_with(isa, &w, &quantize_activations(&x, n, cols), &mut batch);
            for m in 0..n {
                let mut one = vec![0f32; rows];
                let row = quantize_activations(&x[m * cols..(m + 1) * cols], 1, cols);
                matmul_q8_with(isa, &w, &row, &mut one);
                assert_eq!(
                    &batch[m * rows..(m + 1) * rows],
                    &one[..],
                    "{isa:?} {:?} row {m}",
                    w.layout
                );
            }
        }
    }
}

#[test]
fn panel_matrices_stack_only_whole_panels() {
    let cols = 64;
    let part = |rows: usize, seed| {
        to_panels(&Q8Matrix::quantize(rows, cols, &noise(rows * cols, seed))).unwrap()
    };
    let (a, b) = (part(32, 1), part(16, 2));
    let both = Q8Matrix::concat_rows(&[&a, &b]).expect("whole panels stack");
    let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
    both.dequantize_row(40, &mut got);
    b.dequantize_row(8, &mut want);
    assert_eq!(got, want);
    assert!(Q8Matrix::concat_rows(&[&part(20, 3), &b]).is_none());
    let rows = Q8Matrix::quantize(16, cols, &noise(16 * cols, 4));
    assert!(
        Q8Matrix::concat_rows(&[&a, &rows]).is_none(),
        "layouts differ"
    );
}

#[test]
fn panels_keep_f16_scales_and_refuse_a_matrix_whose_scales_are_not_f16() {
    let (rows, cols) = (32, 64);
    let w = Q8Matrix::quantize(rows, cols, &noise(rows * cols, 31));
    let p = to_panels(&w).unwrap();
    assert!(p.scales.is_empty());
    assert_eq!(p.size_in_bytes(), rows * cols + rows * cols / QK * 2);
    let mut odd = w.clone();
    odd.scales[3] = 1.0 + f32::EPSILON;
    assert!(to_panels(&odd).is_none());
    assert_eq!(for_this_cpu(odd).layout, Layout::Rows);
}

#[test]
fn five_bit_panels_give_the_eight_bit_panels_results_exactly() {
    // Q5_0 as a GGUF file holds it; odd batches and a part-filled last panel.
    for (rows, cols, m) in [(40, 640, 1), (131, 640, 29), (256, 128, 16)] {
        let (w, x, _) = candle_reference(GgmlDType::Q5_0, rows, cols, m, 40 + rows as u64);
        let eight = to_panels(&w).unwrap();
        let five = to_five_bit(&eight).expect("Q5_0 values fit in 5 bits");
        assert_eq!(five.layout, Layout::Panels5);
        assert_eq!(
            five.size_in_bytes(),
            rows.next_multiple_of(PANEL) * cols / QK * (20 + 2),
            "5 bits and an f16 scale per value block, as Q5_0"
        );
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in [0, rows / 3, rows - 1] {
            eight.dequantize_row(r, &mut a);
            five.dequantize_row(r, &mut b);
            assert_eq!(a, b, "row {r}");
        }
        let xq = quantize_activations(&x, m, cols);
        for isa in all_isas() {
            let (mut want, mut got) = (vec![0f32; m * rows], vec![f32::NAN; m * rows]);
            matmul_q8_with(isa, &eight, &xq, &mut want);
            matmul_q8_with(isa, &five, &xq, &mut got);
            assert_eq!(got, want, "{isa:?} {rows}x{cols} batch {m}");
        }
    }
    let (q8, _, _) = candle_reference(GgmlDType::Q8_0, 32, 64, 1, 7);
    assert!(
        to_five_bit(&to_panels(&q8).unwrap()).is_none(),
        "8-bit values"
    );
    assert!(to_five_bit(&q8).is_none(), "row layout");
}

/// A k-quant's panels hold exactly the weights candle reads from the file's blocks, every kernel
/// multiplies them alike, and the products are those of the file's weights within the activations'
/// 8-bit rounding.
fn k_quant_panels_match_candle(
    dtype: GgmlDType,
    convert: fn(usize, usize, &[u8]) -> Result<Q8Matrix, String>,
    layout: Layout,
    (file_bytes, panel_bytes): (usize, usize),
) {
    let dev = Device::Cpu;
    for (rows, cols, m) in [(40, 512, 1), (37, 256, 5), (64, 1024, 9), (48, 512, 29)] {
        let w = Tensor::from_vec(noise(rows * cols, 50), (rows, cols), &dev).unwrap();
        let qt = QTensor::quantize(&w, dtype).unwrap();
        let ours = convert(rows, cols, &qt.data().unwrap()).unwrap();
        assert_eq!(ours.layout, layout);
        assert_eq!(
            ours.size_in_bytes(),
            rows.next_multiple_of(PANEL) * cols / QK_K * panel_bytes,
            "{dtype:?}: bytes per 256 values of a row"
        );
        let exact: Vec<f32> = qt
            .dequantize(&dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut row = vec![0f32; cols];
        for r in [0, rows / 2, rows - 1] {
            ours.dequantize_row(r, &mut row);
            assert_eq!(
                row,
                exact[r * cols..(r + 1) * cols],
                "row {r} of {rows}x{cols}"
            );
        }
        let x = noise(m * cols, 51);
        let xq = quantize_activations(&x, m, cols);
        let mut reference = vec![0f32; m * rows];
        matmul_q8_with(Isa::Scalar, &ours, &xq, &mut reference);
        for isa in all_isas() {
            let mut got = vec![f32::NAN; m * rows];
            matmul_q8_with(isa, &ours, &xq, &mut got);
            assert_eq!(got, reference, "{isa:?} {rows}x{cols} batch {m}");
        }
        // Against the file's weights in f32: 8-bit activations move each product by at most
        // 1/254 of |w·x|, so the sums stay within 1 % of Σ|w·x|.
        for (i, &g) in reference.iter().enumerate() {
            let (a, r) = (i / rows, i % rows);
            let pairs = exact[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x[a * cols..(a + 1) * cols]);
            let (want, mass) = pairs.fold((0f32, 0f32), |(s, l), (w, x)| {
                (s + w * x, l + (w * x).abs())
            });
            assert!(
                (g - want).abs() <= 1e-2 * mass,
                "[{i}]: {g} vs {want} (Σ|w·x| {mass})"
            );
        }
    }
    assert!(convert(4, 320, &vec![0; 4 * file_bytes])
        .unwrap_err()
        .contains("multiple of 256"));
    let want = format!("expected {} bytes", 4 * file_bytes);
    assert!(convert(4, 256, &[0; 100]).unwrap_err().contains(&want));
}

#[test]
fn q4_k_panels_hold_the_file_s_weights_and_multiply_like_candle() {
    // 4.5 bits a weight, as the file holds them.
    k_quant_panels_match_candle(GgmlDType::Q4K, from_q4_k, Layout::PanelsQ4K, (144, 144));
}

#[test]
fn q6_k_panels_hold_the_file_s_weights_and_multiply_like_candle() {
    // 6.5625 bits a weight, as the file holds them.
    k_quant_panels_match_candle(GgmlDType::Q6K, from_q6_k, Layout::PanelsQ6K, (210, 210));
}

#[test]
#[cfg(target_arch = "x86_64")]
fn the_avx512_activation_quantizer_gives_the_portable_blocks_bit_for_bit() {
    let wanted = [
        ("avx512f", is_x86_feature_detected!("avx512f")),
        ("avx512bw", is_x86_feature_detected!("avx512bw")),
    ];
    if !cpu_runs("AVX-512 activation quantizer", &lacking(&wanted)) {
        return;
    }
    assert!(has_avx512(), "the features has_avx512 asks");
    // Noise at several magnitudes, an all-zero block, ties at .5 once scaled (amax 127 makes the
    // scale 1), huge, infinite and subnormal values, and a block with a single nonzero value.
    let mut x = Vec::new();
    for scale in [1e-3f32, 1.0, 37.0, 1e20] {
        x.extend(
            noise(32 * 40, scale.to_bits() as u64)
                .iter()
                .map(|v| v * scale),
        );
    }
    x.extend([0.0; 32]);
    x.extend((0..32).map(|i| {
        if i == 0 {
            127.0
        } else {
            (i as f32 - 16.0) + 0.5
        }
    }));
    x.extend((0..32).map(|i| (i as f32 - 15.5) * f32::MIN_POSITIVE / 4.0));
    x.extend((0..32).map(|i| if i == 7 { -3.0 } else { 0.0 }));
    x.extend((0..32).map(|i| if i == 9 { f32::INFINITY } else { i as f32 }));
    let blocks = x.len() / QK;
    let run = |fast: bool| {
        let (mut qs, mut scales) = (vec![0i8; x.len()], vec![0f32; blocks]);
        let (mut sums, mut halves) = (vec![0i32; blocks], vec![0i32; blocks]);
        if fast {
            // SAFETY: AVX-512 was detected above; the buffers fit the blocks.
            unsafe {
                x86::quantize512::quantize_blocks(&x, &mut qs, &mut scales, &mut sums, &mut halves)
            };
        } else {
            q8::quantize_blocks(&x, &mut qs, &mut scales, &mut sums, &mut halves);
        }
        (
            qs,
            scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            sums,
            halves,
        )
    };
    let (fast, portable) = (run(true), run(false));
    for b in 0..blocks {
        let at = b * QK..(b + 1) * QK;
        assert!(
            fast.0[at.clone()] == portable.0[at.clone()]
                && (fast.1[b], fast.2[b], fast.3[b])
                    == (portable.1[b], portable.2[b], portable.3[b]),
            "block {b} of {blocks}: {:?} {:?} vs {:?} {:?}",
            &fast.0[at.clone()],
            (fast.1[b], fast.2[b], fast.3[b]),
            &portable.0[at],
            (portable.1[b], portable.2[b], portable.3[b]),
        );
    }
    assert!(portable.0.contains(&127) && portable.0.contains(&-127));
}

#[test]
fn kernels_are_chosen_only_where_the_cpu_runs_them() {
    use KernelChoice as K;
    assert_eq!(pick(K::Scalar, Isa::Scalar), Ok(Isa::Scalar));
    assert_eq!(pick(K::Auto, Isa::Scalar), Ok(Isa::Scalar));
    #[cfg(target_arch = "x86_64")]
    {
        assert_eq!(pick(K::Auto, Isa::Avx512Vnni), Ok(Isa::Avx512Vnni));
        assert_eq!(pick(K::Vnni, Isa::Avx512Vnni), Ok(Isa::Avx512Vnni));
        assert_eq!(pick(K::Avx2, Isa::Avx512Vnni), Ok(Isa::Avx2));
        assert_eq!(pick(K::Scalar, Isa::Avx512Vnni), Ok(Isa::Scalar));
        assert_eq!(pick(K::Auto, Isa::Avx2), Ok(Isa::Avx2));
        let e = pick(K::Vnni, Isa::Avx2).expect_err("no VNNI");
        assert!(e.contains("AVX-512 VNNI") && e.contains("Avx2"), "{e}");
        let e = pick(K::Avx2, Isa::Scalar).expect_err("no AVX2");
        assert!(e.contains("AVX2"), "{e}");
        assert_eq!(pick(K::Auto, Isa::Amx), Ok(Isa::Amx));
        assert_eq!(pick(K::Amx, Isa::Amx), Ok(Isa::Amx));
        assert_eq!(pick(K::Vnni, Isa::Amx), Ok(Isa::Avx512Vnni));
        assert_eq!(pick(K::Avx2, Isa::Amx), Ok(Isa::Avx2));
        // Where AMX is not granted, `--kernels amx` says why; granted, the best is AMX.
        let e = pick(K::Amx, Isa::Avx512Vnni).expect_err("AMX where the best is VNNI");
        match amx() {
            Amx::Refused(_) => assert!(e.contains("refused") && e.contains("Avx512Vnni"), "{e}"),
            _ => assert!(
                e.contains("lacks AMX int8") && e.contains("Avx512Vnni"),
                "{e}"
            ),
        }
        let e = pick(K::Amx, Isa::Avx2).expect_err("no AMX");
        assert!(e.contains("AMX") && e.contains("Avx2"), "{e}");
        assert_eq!(
            detect_isa() == Isa::Amx,
            *amx() == Amx::Granted && detect_isa().has_vnni()
        );
    }
}
