//! Throughput of the 8-bit matmul kernel at the output projection's shape (262144 x 640), for
//! several batch sizes: `cargo run --release -p hearth-worker --example kernel_speed`.
#![allow(clippy::print_stdout)]

use hearth_worker::kernels::{matmul_q8, quantize_activations, Q8Matrix};
use std::time::Instant;

fn main() {
    let (rows, cols) = (262_144usize, 640usize);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0)
        .collect();
    let w = Q8Matrix::quantize(rows, cols, &w);
    for m in [1usize, 4, 16, 64] {
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let xq = quantize_activations(&x, m, cols);
        let mut out = vec![0f32; m * rows];
        matmul_q8(&w, &xq, &mut out);
        let iters = (64 / m).max(2);
        let t = Instant::now();
        for _ in 0..iters {
            matmul_q8(&w, &xq, &mut out);
        }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        println!(
            "m={m:3}: {:7.2} ms/call  {:6.1} GMAC/s  {:5.1} GB/s of weights",
            s * 1e3,
            (rows * cols * m) as f64 / s / 1e9,
            w.size_in_bytes() as f64 / s / 1e9
        );
    }
}
