//! Elementwise math the forward passes and the sampler share, kept below both: an exponential
//! in plain arithmetic that LLVM vectorizes.

/// `e^x` to within a few ulp, in plain arithmetic that LLVM vectorizes (libm's `expf` is a call
/// per element, and the forward pass and sampler take tens of millions of exponentials).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUND;
    let k = shifted - ROUND;
    let r = x - k * LN2_HI - k * LN2_LO;
    // e^r on [-ln2/2, ln2/2], Taylor to degree 6 (relative error below 2e-7).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // The integer k, |k| <= 127, is in `shifted`'s low mantissa bits (its unit there is 1): read
    // it from the bits rather than by `as i32`, whose saturating conversion LLVM does not
    // vectorize.
    let k = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    p * f32::from_bits(((k + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        for i in -2000..=2000 {
            let x = i as f32 / 25.0;
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert!(exp(-1000.0) >= 0.0 && exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }
}
