//! Element-wise pieces of the forward pass on plain f32 slices: RMS norm, rotary embedding,
//! GELU, dot products. Written so LLVM vectorizes them (independent accumulators, no bounds
//! checks in the inner loops).

use crate::math::exp;

/// `x * w / rms(x)` over each row of width `w.len()`. Gemma's `(1 + w)` is folded into `w` at load.
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let ms = dot(row, row) / w.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v *= inv * g;
        }
    }
}

/// As [`rms_norm_rows`], writing into `out`.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(x);
    rms_norm_rows(out, w, eps);
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// GELU (tanh approximation) of `gate`, times `up`, into `gate`.
/// Uses `0.5·x·(1 + tanh(u)) = x / (1 + e^(-2u))`.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let t = C * (x + 0.044_715 * x * x * x);
        *g = x / (1.0 + exp(-2.0 * t)) * u;
    }
}

/// Inverse frequencies of the rotary embedding for a head of `dim` values.
pub fn rope_inv_freq(dim: usize, base: f32, scale: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / (base.powf(2.0 * i as f32 / dim as f32) * scale))
        .collect()
}

/// The rotary embedding's cosines and sines of a step's positions (`pos · inv_freq`): made once a
/// step and used by every layer that shares the frequencies, for queries and keys alike.
#[derive(Debug)]
pub struct RopeAngles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeAngles {
    pub fn new(positions: &[usize], inv_freq: &[f32]) -> Self {
        let half = inv_freq.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions.len() * half),
            Vec::with_capacity(positions.len() * half),
        );
        for &pos in positions {
            for f in inv_freq {
                let (s, c) = (pos as f32 * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        Self { half, cos, sin }
    }

    /// Rotates each head of `x` (heads of twice as many values as there are frequencies) by the
    /// angles of position `t` (of those given to [`RopeAngles::new`]), rotating the two halves of
    /// the head together (GPT-NeoX layout, as Gemma uses).
    pub fn rotate(&self, t: usize, x: &mut [f32]) {
        let half = self.half;
        let (cos, sin) = (
            &self.cos[t * half..(t + 1) * half],
            &self.sin[t * half..(t + 1) * half],
        );
        for head in x.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = (*v / cap).tanh() * cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_gives_unit_rms_with_unit_weights() {
        let mut x = vec![3.0, -4.0, 0.0, 5.0];
        rms_norm_rows(&mut x, &[1.0; 4], 0.0);
        let rms = (dot(&x, &x) / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let inv = rope_inv_freq(8, 10_000.0, 1.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut x = orig.clone();
        RopeAngles::new(&[0], &inv).rotate(0, &mut x);
        assert_eq!(x, orig);
        RopeAngles::new(&[37], &inv).rotate(0, &mut x);
        for (h, o) in x.chunks(8).zip(orig.chunks(8)) {
            assert!((dot(h, h) - dot(o, o)).abs() < 1e-3);
        }
    }

    #[test]
    fn gelu_matches_libms_tanh() {
        for i in -2000..=2000 {
            let x = i as f32 / 25.0;
            let mut g = [x];
            gelu_mul(&mut g, &[1.0]);
            let want = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh());
            assert!(
                (g[0] - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "gelu({x}) = {}, want {want}",
                g[0]
            );
        }
    }

    #[test]
    fn a_steps_angles_rotate_each_position_as_rope_does() {
        let (dim, heads) = (8, 3);
        let inv = rope_inv_freq(dim, 10_000.0, 1.0);
        let positions = [0usize, 5, 37, 4096];
        let angles = RopeAngles::new(&positions, &inv);
        for (t, &pos) in positions.iter().enumerate() {
            let x: Vec<f32> = (0..dim * heads).map(|i| (i as f32 * 0.7).sin()).collect();
            let (mut want, mut got) = (x.clone(), x);
            // Each position's angles computed on their own, as a step of one token would.
            let half = dim / 2;
            for head in want.chunks_exact_mut(dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (s, c) = (pos as f32 * inv[i]).sin_cos();
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * c - x1 * s;
                    b[i] = x0 * s + x1 * c;
                }
            }
            angles.rotate(t, &mut got);
            assert_eq!(got, want, "position {pos}");
        }
    }

    #[test]
    fn dot_handles_remainders() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f32 = a.iter().map(|v| v * v).sum();
        assert_eq!(dot(&a, &a), want);
    }
}
