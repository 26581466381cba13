//! The tile model against the instruction reference (and against the instructions, where this
//! CPU has them), and the AMX kernel against the VNNI kernel bit for bit, through the model on
//! any machine with AVX-512 and through the instructions where AMX is granted.
#![cfg(target_arch = "x86_64")]

use super::kernel::{self, block_sums};
use super::model::Model;
use super::tiles::{Hardware, TileConfig, Tiles};
use crate::kernels::tests::{cpu_runs, lacking, noise};
use crate::kernels::{
    from_q4_k, from_q6_k, panels, quantize_activations, run_tasks, to_five_bit, to_panels, ActQ8,
    Layout, Q8Matrix, SpinPool, PANEL,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Whether the AVX-512 parts of the kernel (rebuilding blocks, scaling sums) run here.
fn avx512_runs() -> bool {
    cpu_runs(
        "AMX kernel (AVX-512 parts)",
        &lacking(&[
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
        ]),
    )
}

/// The tile instructions, where this CPU has them and Linux granted them; reported either way.
fn hardware() -> Option<Hardware> {
    let found = Hardware::new();
    let why = format!("AMX tile state ({})", super::amx());
    let missing = if found.is_some() {
        vec![]
    } else {
        vec![why.as_str()]
    };
    cpu_runs("AMX tile instructions", &missing);
    found
}

/// Deterministic bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Runs `ops` on `tiles` after configuring `config`, and returns tile 2 stored (16 rows of 64
/// bytes, `0xEE` where the tile's shape writes nothing).
fn run<T: Tiles>(tiles: &mut T, config: &TileConfig, ops: impl FnOnce(&mut T)) -> Vec<u8> {
    let mut out = vec![0xEEu8; 16 * 64];
    // SAFETY: a palette-1 configuration; `out` holds 16 rows of 64 bytes.
    unsafe {
        tiles.configure(config);
        ops(tiles);
        tiles.store::<2>(out.as_mut_ptr(), 64);
    }
    tiles.release();
    out
}

#[test]
fn the_model_multiplies_signed_rows_by_unsigned_groups_of_four() {
    // a: 2 rows × 8 bytes (signed); b: 2 rows × 12 bytes (3 columns of 4 unsigned values).
    let a: [i8; 16] = [1, -2, 3, -4, 5, -6, 7, -8, -128, 127, 0, 1, 2, 3, 4, 5];
    let b: [u8; 24] = [
        1, 2, 3, 4, 255, 0, 1, 128, 10, 20, 30, 40, //
        5, 6, 7, 8, 0, 255, 2, 3, 50, 60, 70, 80,
    ];
    let config = TileConfig::new()
        .with(0, 2, 8)
        .with(1, 2, 12)
        .with(2, 2, 12);
    let stored = run(&mut Model, &config, |t| unsafe {
        t.load::<0>(a.as_ptr().cast(), 8);
        t.load::<1>(b.as_ptr(), 12);
        t.zero::<2>();
        t.dot::<2, 0, 1>();
        t.dot::<2, 0, 1>(); // accumulates: twice the products
    });
    let cell = |m: usize, n: usize| {
        let at = m * 64 + 4 * n;
        i32::from_le_bytes(stored[at..at + 4].try_into().unwrap())
    };
    for m in 0..2 {
        for n in 0..3 {
            let mut want = 0;
            for k in 0..2 {
                for i in 0..4 {
                    want += a[m * 8 + 4 * k + i] as i32 * b[k * 12 + 4 * n + i] as i32;
                }
            }
            assert_eq!(cell(m, n), 2 * want, "c[{m}][{n}]");
        }
    }
    // Only the configured 2 rows × 12 bytes were stored.
    assert!(stored[12..64]
        .iter()
        .chain(&stored[64 + 12..])
        .all(|&v| v == 0xEE));
}

#[test]
fn the_model_loads_with_a_stride_and_zeroes_what_lies_past_the_shape() {
    let src = bytes(8 * 100, 1);
    let wide = TileConfig::new().with(2, 16, 64);
    let narrow = TileConfig::new().with(2, 3, 8);
    let stored = run(&mut Model, &narrow, |t| unsafe {
        t.load::<2>(src.as_ptr(), 100)
    });
    for r in 0..3 {
        assert_eq!(
            &stored[r * 64..r * 64 + 8],
            &src[r * 100..r * 100 + 8],
            "row {r}"
        );
    }
    let zeroed = run(&mut Model, &wide, |_| {});
    assert!(zeroed.iter().all(|&v| v == 0), "LDTILECFG zeroes the tiles");
}

#[test]
fn the_model_sums_wrap_as_32_bit_integers() {
    let a = [127i8; 64];
    let b = [255u8; 64 * 16];
    let config = TileConfig::new()
        .with(0, 1, 64)
        .with(1, 16, 64)
        .with(2, 1, 64);
    let start = [i32::MAX; 16];
    let stored = run(&mut Model, &config, |t| unsafe {
        t.load::<0>(a.as_ptr().cast(), 64);
        t.load::<1>(b.as_ptr(), 64);
        t.load::<2>(start.as_ptr().cast(), 64);
        t.dot::<2, 0, 1>();
    });
    let want = i32::MAX.wrapping_add(64 * 127 * 255);
    assert_eq!(i32::from_le_bytes(stored[..4].try_into().unwrap()), want);
}

#[test]
#[should_panic(expected = "do not chain (#UD)")]
fn the_model_refuses_shapes_the_instruction_refuses() {
    let config = TileConfig::new()
        .with(0, 4, 32)
        .with(1, 4, 64)
        .with(2, 4, 64);
    run(&mut Model, &config, |t| unsafe { t.dot::<2, 0, 1>() });
}

#[test]
fn a_thread_must_configure_its_own_tiles() {
    let config = TileConfig::new().with(0, 1, 4);
    // SAFETY: a palette-1 configuration.
    unsafe { Model.configure(&config) };
    let other = std::thread::spawn(|| unsafe { Model.zero::<0>() }).join();
    let why = other.expect_err("another thread's tile use");
    let why = why.downcast_ref::<String>().expect("a message");
    assert!(
        why.contains("this thread has loaded no tile configuration"),
        "{why}"
    );
    // SAFETY: configured on this thread.
    unsafe { Model.zero::<0>() };
    Model.release();
}

/// `c + a · b` on `tiles`, with tiles 0, 1 and 2 shaped by `config`, `a` read 80 bytes a row.
fn product<T: Tiles>(
    tiles: &mut T,
    config: &TileConfig,
    (a, b, c): (&[u8], &[u8], &[u8]),
) -> Vec<u8> {
    run(tiles, config, |t| unsafe {
        t.load::<0>(a.as_ptr(), 80);
        t.load::<1>(b.as_ptr(), 64);
        t.load::<2>(c.as_ptr(), 64);
        t.dot::<2, 0, 1>();
    })
}

#[test]
fn the_model_and_the_instructions_agree_on_every_shape_the_kernels_use() {
    let Some(mut hw) = hardware() else { return };
    for (rows, k) in [(16, 32), (7, 32), (16, 16), (1, 16), (16, 64), (3, 64)] {
        let config = TileConfig::new()
            .with(0, rows, k)
            .with(1, k / 4, 64)
            .with(2, rows, 64);
        let (a, b, c) = (
            bytes(16 * 80, rows as u64),
            bytes(16 * 64, k as u64),
            bytes(16 * 64, 9),
        );
        let model = product(&mut Model, &config, (&a, &b, &c));
        let real = product(&mut hw, &config, (&a, &b, &c));
        assert_eq!(model, real, "{rows} rows × {k} bytes");
    }
}

/// A `rows × cols` matrix of deterministic weights in `layout`, as the model loads a GGUF file
/// of the matching format.
fn matrix(layout: Layout, rows: usize, cols: usize, seed: u64) -> Q8Matrix {
    let dtype = match layout {
        Layout::Panels => GgmlDType::Q8_0,
        Layout::Panels5 => GgmlDType::Q5_0,
        Layout::PanelsQ4K => GgmlDType::Q4K,
        Layout::PanelsQ6K => GgmlDType::Q6K,
        Layout::Rows => unreachable!("panels only"),
    };
    let w = Tensor::from_vec(noise(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let data = QTensor::quantize(&w, dtype)
        .unwrap()
        .data()
        .unwrap()
        .to_vec();
    match layout {
        Layout::Panels => to_panels(&Q8Matrix::from_q8_0(rows, cols, &data).unwrap()).unwrap(),
        Layout::Panels5 => {
            let m = to_panels(&Q8Matrix::from_q5_0(rows, cols, &data).unwrap()).unwrap();
            to_five_bit(&m).expect("Q5_0 values fit five bits")
        }
        Layout::PanelsQ4K => from_q4_k(rows, cols, &data).unwrap(),
        _ => from_q6_k(rows, cols, &data).unwrap(),
    }
}

/// `m` activation rows, the first at full scale (values ±127 after quantizing).
fn activations(m: usize, cols: usize, seed: u64) -> ActQ8 {
    let mut x = noise(m * cols, seed);
    for (i, v) in x[..cols].iter_mut().enumerate() {
        *v = if i % 3 == 0 { -1.0 } else { 1.0 };
    }
    quantize_activations(&x, m, cols)
}

const FORMATS: [Layout; 4] = [
    Layout::Panels,
    Layout::Panels5,
    Layout::PanelsQ4K,
    Layout::PanelsQ6K,
];

/// Shapes for a format: rows not a multiple of 16 among them; k-quants need 256-value widths.
fn shapes(layout: Layout) -> Vec<(usize, usize)> {
    match layout {
        Layout::PanelsQ4K | Layout::PanelsQ6K => vec![(16, 256), (70, 512), (33, 256)],
        _ => vec![(16, 32), (70, 96), (131, 640), (33, 64)],
    }
}

/// The VNNI panel kernel's output for all of `w`'s columns.
fn vnni(w: &Q8Matrix, x: &ActQ8) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.rows * w.rows];
    // SAFETY: the caller checked AVX-512 F, BW and VNNI.
    unsafe { panels::vnni512::matmul_rows(w, x, 0, w.rows, &mut out) };
    out
}

fn amx_with<T: Tiles>(tiles: &mut T, w: &Q8Matrix, x: &ActQ8) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.rows * w.rows];
    // SAFETY: the caller checked AVX-512 F, BW and VNNI.
    unsafe { kernel::matmul_rows(tiles, w, x, 0, w.rows, &mut out) };
    out
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{i}]: {g} vs {w}");
    }
}

#[test]
fn every_format_s_block_sums_are_the_vnni_kernel_s() {
    if !avx512_runs() {
        return;
    }
    let mut hw = hardware();
    for layout in FORMATS {
        for (rows, cols) in shapes(layout) {
            let w = matrix(layout, rows, cols, rows as u64);
            for m in [1usize, 5, 16, 21] {
                let x = activations(m, cols, m as u64 + 7);
                for (p, b) in [(0, 0), (rows.div_ceil(PANEL) - 1, cols / 32 - 1)] {
                    let group = m.min(16);
                    // SAFETY: AVX-512 was checked; the panel, block and rows exist.
                    let want: Vec<_> = (0..group)
                        .map(|r| unsafe { panels::vnni512::block_sums(&w, &x, (p, b), r) })
                        .collect();
                    // The tiles give the halves in turn, each with every row.
                    let halves = want[0].len();
                    let want: Vec<_> = (0..halves)
                        .flat_map(|h| want.iter().map(move |r| r[h]))
                        .collect();
                    let what = format!("{layout:?} {rows}x{cols} m={m} panel {p} block {b}");
                    let got = unsafe { block_sums(&mut Model, &w, &x, (p, b), (0, group)) };
                    assert_eq!(got, want, "model: {what}");
                    if let Some(hw) = hw.as_mut() {
                        let got = unsafe { block_sums(hw, &w, &x, (p, b), (0, group)) };
                        assert_eq!(got, want, "instructions: {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_format_gives_the_vnni_kernel_s_rows_bit_for_bit() {
    if !avx512_runs() {
        return;
    }
    let mut hw = hardware();
    for layout in FORMATS {
        for (rows, cols) in shapes(layout) {
            let w = matrix(layout, rows, cols, rows as u64 + 100);
            // Activation rows below, at and past a tile's 16, and several whole tiles and a rest.
            for m in [1usize, 7, 16, 17, 40] {
                let x = activations(m, cols, m as u64);
                let want = vnni(&w, &x);
                let what = format!("{layout:?} {rows}x{cols} m={m}");
                same_bits(
                    &amx_with(&mut Model, &w, &x),
                    &want,
                    &format!("model: {what}"),
                );
                if let Some(hw) = hw.as_mut() {
                    same_bits(
                        &amx_with(hw, &w, &x),
                        &want,
                        &format!("instructions: {what}"),
                    );
                }
            }
        }
    }
}

#[test]
fn the_output_projection_s_262k_rows_through_the_pool_with_summaries_are_the_vnni_kernel_s() {
    if !avx512_runs() {
        return;
    }
    // The output projection's row count, narrow so the model runs it in seconds; 17 rows (a tile
    // and a rest); pieces handed to `then` as the sampler's summaries are.
    let (rows, cols, m, piece) = (262_144, 64, 17, 1024);
    let w = matrix(Layout::Panels, rows, cols, 3);
    let x = activations(m, cols, 4);
    let want = vnni(&w, &x);
    let threads = std::sync::Mutex::new(std::collections::HashSet::new());
    let pieces = std::sync::atomic::AtomicUsize::new(0);
    let then = |cols: std::ops::Range<usize>, rows: &mut [&mut [f32]]| {
        assert!(cols.start.is_multiple_of(piece) && rows.len() == m);
        pieces.fetch_add(
            cols.len().div_ceil(piece),
            std::sync::atomic::Ordering::Relaxed,
        );
    };
    let mut got = vec![f32::NAN; m * rows];
    let (caller, pool) = (std::thread::current().id(), SpinPool::global().threads());
    let kernel = |r0: usize, r1: usize, out: &mut [f32]| {
        let me = std::thread::current().id();
        threads.lock().unwrap().insert(me);
        // SAFETY: AVX-512 was checked.
        unsafe { kernel::matmul_rows(&mut Model, &w, &x, r0, r1, out) };
        // The caller holds its first task until a helper has taken one (however busy the
        // machine), so the tasks surely run on more than one thread.
        let alone = || threads.lock().unwrap().len() < 2;
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while me == caller && pool > 1 && alone() && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
    };
    run_tasks(&w, &x, &mut got, Some((piece, &then)), &kernel);
    same_bits(&got, &want, "model through the pool");
    assert_eq!(
        pieces.swap(0, std::sync::atomic::Ordering::Relaxed),
        rows / piece
    );
    // Each task configured the tiles on the thread that ran it (the model refuses a thread
    // that did not), and the pool spread the tasks over its threads.
    let used = threads.into_inner().unwrap().len();
    assert!(
        used > 1 || pool == 1,
        "{used} of the pool's {pool} threads ran tasks"
    );
    if hardware().is_some() {
        let mut got = vec![f32::NAN; m * rows];
        let kernel = |r0: usize, r1: usize, out: &mut [f32]| {
            let mut tiles = Hardware::new().expect("granted above");
            // SAFETY: AVX-512 was checked; AMX granted.
            unsafe { kernel::matmul_rows(&mut tiles, &w, &x, r0, r1, out) };
        };
        run_tasks(&w, &x, &mut got, Some((piece, &then)), &kernel);
        same_bits(&got, &want, "instructions through the pool");
    }
}
