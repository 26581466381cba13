//! `hearth-worker`: the GPU worker binary.
fn main() {}
