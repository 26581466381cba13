//! Launches of the fused kernels (`kernels.cu`, compiled to PTX by build.rs with the pinned
//! toolkit) for the ops of [`super::ops`] on a CUDA device: the only CUDA code of the forward
//! pass. Every kernel runs on the device's one stream (see `crate::device`), after the work
//! issued before it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage};
use half::f16;

use super::ops::{EmbedNorm, KvWrite, PagedAttention, QPrep, ResidualNorm};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
const MODULE: &str = "hearth_kernels";

/// Kernel `name` of the module, loaded (and the PTX compiled by the driver) at first use.
fn func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: not contiguous")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn spread(total: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (total.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn heads(n: usize, h: usize, hd: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, h as u32, 1),
        block_dim: (hd as u32 / 2, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn embed_norm(
    op: &EmbedNorm,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device().clone();
    let (n, h) = l1.shape().dims2()?;
    let (emb, w) = (
        view::<f32>(s1, l1, "embedding")?,
        view::<f32>(s2, l2, "norm")?,
    );
    let mut out = unsafe { dev.alloc::<f32>(2 * n * h)? };
    let f = func(&dev, "embed_norm")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (n_, h_) = (n as i32, h as i32);
    b.arg(&emb).arg(&w).arg(&mut out).arg(&n_).arg(&h_);
    b.arg(&op.scale).arg(&op.eps);
    unsafe { b.launch(rows(n)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((2, n, h)),
    ))
}

pub(super) fn residual_norm(
    op: &ResidualNorm,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device().clone();
    let (n, h) = l1.shape().dims2()?;
    let (x, o, w) = (
        view::<f32>(s1, l1, "residual")?,
        view::<f32>(s2, l2, "block output")?,
        view::<f32>(s3, l3, "norms")?,
    );
    let mut out = unsafe { dev.alloc::<f32>(2 * n * h)? };
    let f = func(&dev, "residual_norm")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (n_, h_, post) = (n as i32, h as i32, i32::from(op.post));
    b.arg(&x).arg(&o).arg(&w).arg(&mut out).arg(&n_).arg(&h_);
    b.arg(&op.eps).arg(&post);
    unsafe { b.launch(rows(n)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((2, n, h)),
    ))
}

pub(super) fn q_prep(
    op: &QPrep,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device().clone();
    let hs = op.heads;
    let n = op.meta.n;
    let (qkv, meta, aux) = (
        view::<f32>(s1, l1, "qkv")?,
        view::<u32>(s2, l2, "meta")?,
        view::<f32>(s3, l3, "aux")?,
    );
    let mut out = unsafe { dev.alloc::<f32>(n * hs.nh * hs.hd)? };
    let f = func(&dev, "q_prep")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let ints = [n, hs.nh, hs.nkv, hs.hd].map(|v| v as i32);
    let has_norm = i32::from(hs.qk_norm);
    b.arg(&qkv).arg(&meta).arg(&aux).arg(&mut out);
    b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]);
    b.arg(&hs.eps).arg(&has_norm);
    unsafe { b.launch(heads(n, hs.nh, hs.hd)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((n, hs.nh * hs.hd)),
    ))
}

pub(super) fn kv_write(
    op: &KvWrite,
    dst: &mut CudaStorage,
    dst_l: &Layout,
    srcs: [(&CudaStorage, &Layout); 2],
) -> Result<()> {
    let [(s1, l1), (s2, l2)] = srcs;
    let dev = s1.device().clone();
    let hs = op.heads;
    let n = op.meta.n;
    let (_, slots, _) = dst_l.shape().dims3()?;
    let (qkv, meta) = (view::<f32>(s1, l1, "qkv")?, view::<u32>(s2, l2, "meta")?);
    // The layer's norms and frequencies ride along with the op; read in place (a read lock on
    // a tensor other than the cache, held until the launch is issued).
    let (aux_storage, aux_l) = op.aux.storage_and_layout();
    let Storage::Cuda(aux_storage) = &*aux_storage else {
        bail!("kv_write: the layer's aux tensor is not on the device")
    };
    let aux = view::<f32>(aux_storage, aux_l, "aux")?;
    let ints = [n, hs.nh, hs.nkv, hs.hd].map(|v| v as i32);
    let (has_norm, mb, bs) = (
        i32::from(hs.qk_norm),
        op.meta.max_blocks as i32,
        op.meta.block_size as i32,
    );
    let slots = slots as u64;
    let start = dst_l.start_offset();
    let cfg = heads(n, hs.nkv, hs.hd);
    macro_rules! launch {
        ($name:literal, $t:ty) => {{
            let mut cache: CudaViewMut<'_, $t> = dst.as_cuda_slice_mut::<$t>()?.slice_mut(start..);
            let f = func(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&qkv).arg(&meta).arg(&aux).arg(&mut cache);
            b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]);
            b.arg(&hs.eps).arg(&has_norm).arg(&mb).arg(&bs).arg(&slots);
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match dst.dtype() {
        DType::F16 => launch!("kv_write_f16", f16),
        DType::F32 => launch!("kv_write_f32", f32),
        other => bail!("kv_write: a {other:?} cache"),
    }
    Ok(())
}

pub(super) fn paged_attention(
    op: &PagedAttention,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device().clone();
    let hs = op.heads;
    let n = op.meta.n;
    let (_, slots, _) = l2.shape().dims3()?;
    let name = match (s2.dtype(), hs.hd) {
        (DType::F16, 64) => "paged_attention_f16_64",
        (DType::F16, 128) => "paged_attention_f16_128",
        (DType::F16, 256) => "paged_attention_f16_256",
        (DType::F32, 64) => "paged_attention_f32_64",
        (DType::F32, 128) => "paged_attention_f32_128",
        (DType::F32, 256) => "paged_attention_f32_256",
        (t, hd) => bail!("paged_attention: no kernel for a {t:?} cache with {hd}-value heads"),
    };
    let (q, meta) = (
        view::<f32>(s1, l1, "queries")?,
        view::<u32>(s3, l3, "meta")?,
    );
    let mut out = unsafe { dev.alloc::<f32>(n * hs.nh * hs.hd)? };
    let ints = [n, hs.nh, hs.nkv, op.window.unwrap_or(0)].map(|v| v as i32);
    let softcap = op.softcap.unwrap_or(0.0);
    let (mb, bs, slots) = (
        op.meta.max_blocks as i32,
        op.meta.block_size as i32,
        slots as u64,
    );
    // A warp per 64 positions the step's tables can hold, 4 to 16 (the kernel's most): few
    // sequences' long contexts are split over more of the block's warps.
    let span = op.meta.max_blocks * op.meta.block_size;
    let warps = (span / 64).clamp(4, 16).next_power_of_two().min(16);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, hs.nh as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = func(&dev, name)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    macro_rules! go {
        ($t:ty) => {{
            let cache = view::<$t>(s2, l2, "cache")?;
            b.arg(&q).arg(&cache).arg(&meta).arg(&mut out);
            b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]);
            b.arg(&op.scale).arg(&softcap).arg(&mb).arg(&bs).arg(&slots);
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match s2.dtype() {
        DType::F16 => go!(f16),
        _ => go!(f32),
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), l1.shape().clone()))
}

pub(super) fn gelu_mul(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device().clone();
    let (n, two_f) = l.shape().dims2()?;
    let f_ = two_f / 2;
    let gu = view::<f32>(s, l, "gate/up")?;
    let mut out = unsafe { dev.alloc::<f32>(n * f_)? };
    let f = func(&dev, "gelu_mul")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (n_, ff) = (n as i32, f_ as i32);
    b.arg(&gu).arg(&mut out).arg(&n_).arg(&ff);
    unsafe { b.launch(spread(n * f_)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, f_))))
}

pub(super) fn softcap(cap: f32, s: &mut CudaStorage, l: &Layout) -> Result<()> {
    let dev = s.device().clone();
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("softcap: not contiguous")
    };
    let mut x = s.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let count = (b - a) as u64;
    let f = func(&dev, "softcap_inplace")?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&f);
    builder.arg(&mut x).arg(&count).arg(&cap);
    unsafe { builder.launch(spread(b - a)) }.w()?;
    Ok(())
}

pub(super) fn logit_summary(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device().clone();
    let (rows, vocab) = l.shape().dims2()?;
    let logits = view::<f32>(s, l, "logits")?;
    let mut out = unsafe { dev.alloc::<f32>(rows * 3)? };
    let f = func(&dev, "logit_summary")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let v = vocab as i32;
    b.arg(&logits).arg(&mut out).arg(&v);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((rows, 3)),
    ))
}
