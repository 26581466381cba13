//! Throughput of the matmul kernels: the output projection's shape (262144 x 640, 8-bit) at several
//! batch sizes, then Gemma 3 270M's layer shapes at one row (decode), 16 rows (a batched decode
//! step) and 512 rows (prefill), in the row layout and, where this CPU has AVX-512 VNNI, the panel
//! layout the model loads into; last, the layer shapes in the formats the Q4_K_M file holds them
//! (Q5_0 for the 640-wide matrices, Q4_K and Q6_K for the others), as the model loads them.
//! Where AMX is granted, each panel product runs on the VNNI kernel and on the AMX one:
//! `cargo run --release -p hearth-worker --example kernel_speed`.
#![allow(clippy::print_stdout)]

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use hearth_worker::kernels::{
    for_this_cpu, k_quant_for_this_cpu, kernel_isa, matmul_q8_with, quantize_activations, Isa,
    Layout, Q8Matrix,
};
use std::time::Instant;

/// The matrix in the row layout, and in the panel layout when this CPU's kernel takes it.
fn matrices(rows: usize, cols: usize) -> Vec<Q8Matrix> {
    let m = Q8Matrix::quantize(rows, cols, &weights(rows, cols));
    let fast = for_this_cpu(m.clone());
    if fast.layout == Layout::Rows {
        vec![m]
    } else {
        vec![m, fast]
    }
}

fn weights(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
        .collect()
}

/// The matrix in GGUF format `dtype`, loaded as the model loads a file's matrix of that format.
fn from_file_format(rows: usize, cols: usize, dtype: GgmlDType) -> Q8Matrix {
    let w = Tensor::from_vec(weights(rows, cols), (rows, cols), &Device::Cpu).expect("shape");
    let q = QTensor::quantize(&w, dtype).expect("quantizes");
    let data = q.data().expect("bytes");
    match k_quant_for_this_cpu(dtype, rows, cols, &data) {
        Some(m) => m.expect("k-quant blocks"),
        None => for_this_cpu(Q8Matrix::from_q5_0(rows, cols, &data).expect("Q5_0 blocks")),
    }
}

/// The kernels to time `w` with: this CPU's, and where that is AMX, VNNI's too (panels only).
fn kernels_for(w: &Q8Matrix) -> Vec<Isa> {
    let isa = kernel_isa();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && w.layout != Layout::Rows {
        return vec![Isa::Avx512Vnni, Isa::Amx];
    }
    let _ = w;
    vec![isa]
}

/// Seconds per call of `w · x` for `m` activation rows on `isa`'s kernel, averaged over calls
/// worth `macs` in all.
fn time(isa: Isa, w: &Q8Matrix, m: usize, macs: usize) -> f64 {
    let x: Vec<f32> = (0..m * w.cols)
        .map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let xq = quantize_activations(&x, m, w.cols);
    let mut out = vec![0f32; m * w.rows];
    matmul_q8_with(isa, w, &xq, &mut out);
    let iters = (macs / (w.rows * w.cols * m)).max(2);
    let t = Instant::now();
    for _ in 0..iters {
        matmul_q8_with(isa, w, &xq, &mut out);
    }
    t.elapsed().as_secs_f64() / iters as f64
}

/// What these cores can issue at most: `vpdpbusd` on registers only (12 independent chains per
/// thread, one thread per core), in multiply-adds per second.
#[cfg(target_arch = "x86_64")]
fn vnni_peak() -> Option<f64> {
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn chains(iters: usize) -> i32 {
        use std::arch::x86_64::*;
        let a = std::hint::black_box(_mm512_set1_epi8(3));
        let b = std::hint::black_box(_mm512_set1_epi8(-2));
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, a, b);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_si512(), |s, &v| _mm512_add_epi32(s, v));
        _mm512_reduce_add_epi32(sum)
    }
    if !(is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw")) {
        return None;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let iters = 50_000_000;
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            // SAFETY: the CPU features were checked above.
            s.spawn(|| std::hint::black_box(unsafe { chains(iters) }));
        }
    });
    Some((threads * iters * 12 * 64) as f64 / t.elapsed().as_secs_f64())
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    if let Some(peak) = vnni_peak() {
        println!(
            "peak (vpdpbusd on registers, every core): {:.1} GMAC/s",
            peak / 1e9
        );
    }
    for w in matrices(262_144, 640) {
        for (isa, m) in kernels_for(&w)
            .into_iter()
            .flat_map(|isa| [1usize, 4, 16, 64].map(|m| (isa, m)))
        {
            let s = time(isa, &w, m, 64 * 262_144 * 640);
            println!(
                "output 262144x640 {:?} {isa:?}, m={m:3}: {:7.2} ms/call  {:6.1} GMAC/s  {:5.1} GB/s of weights",
                w.layout,
                s * 1e3,
                (w.rows * w.cols * m) as f64 / s / 1e9,
                w.size_in_bytes() as f64 / s / 1e9
            );
        }
    }
    // Fused QKV, fused gate/up, down, attention output.
    for (rows, cols) in [(1536usize, 640usize), (4096, 640), (640, 2048), (640, 1024)] {
        for w in matrices(rows, cols) {
            layer(&format!("{rows}x{cols} {:?}", w.layout), &w);
        }
    }
    // As the Q4_K_M file holds Gemma 3 270M's layers: the 640-wide ones in Q5_0.
    for (rows, cols, dtype) in [
        (1536usize, 640usize, GgmlDType::Q5_0),
        (4096, 640, GgmlDType::Q5_0),
        (640, 2048, GgmlDType::Q4K),
        (640, 2048, GgmlDType::Q6K),
        (640, 1024, GgmlDType::Q4K),
    ] {
        let w = from_file_format(rows, cols, dtype);
        layer(&format!("{rows}x{cols} {dtype:?} as {:?}", w.layout), &w);
    }
}

/// A layer-sized product at 1 row (decode), 16 (a batched step) and 512 (prefill).
fn layer(label: &str, w: &Q8Matrix) {
    for (isa, m) in kernels_for(w)
        .into_iter()
        .flat_map(|isa| [1usize, 16, 64, 512].map(|m| (isa, m)))
    {
        let s = time(isa, w, m, 20_000_000_000);
        println!(
            "layer {label} {isa:?}, m={m:3}: {:8.3} ms/call  {:6.1} GMAC/s",
            s * 1e3,
            (w.rows * w.cols * m) as f64 / s / 1e9,
        );
    }
}
