//! Greedy decode steps in fixed shapes, replayed from CUDA graphs: a decode step of a small
//! model is a few hundred short kernels, and issuing them one by one takes the host longer than
//! the GPU takes to run them.
//!
//! A step's shape is its sequences, padded to a power of two, and its block tables' width,
//! rounded up to one. Each shape gets a bucket: a meta tensor and a summary tensor that stay in
//! place, so a graph captured once reads the next step's inputs and writes its summaries where
//! it did then. The first step of a shape runs eagerly (its result is that step's), then the
//! same work is captured; later steps of that shape upload their meta, launch the graph and
//! download the summaries: three device operations. Padding rows decode token 0 at position 0
//! into the cache's scratch block, which no sequence owns. Without CUDA (tests on the CPU), or
//! where a capture fails, buckets run eagerly, padded the same way.

use std::collections::HashMap;

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor};

use super::ops::StepMeta;
use super::step::{from_device, Sampled};
use super::{DeviceKv, GenericModel};
use crate::model::{ModelError, SeqChunk};
use crate::sampling::LogitSummary;

/// The replayable decode steps of one K/V store (graphs hold its addresses).
#[derive(Debug, Default)]
pub struct StepGraphs {
    /// By (padded sequences, blocks per table).
    buckets: HashMap<(usize, usize), Bucket>,
    /// Capture graphs (CUDA); otherwise buckets run eagerly.
    capture: bool,
    /// The most tokens a step of this engine can hold: candle's quantized products keep
    /// scratch memory that grows to the largest step seen and moves when it grows, which would
    /// leave a captured graph reading freed memory, so it is grown to this before the first
    /// capture.
    max_step_tokens: usize,
    /// Whether that was done.
    warmed: bool,
}

impl StepGraphs {
    pub fn new(capture: bool, max_step_tokens: usize) -> Self {
        Self {
            buckets: HashMap::new(),
            capture,
            max_step_tokens,
            warmed: false,
        }
    }
}

#[derive(Debug)]
struct Bucket {
    /// The step's meta (ids, positions, sequences, tables), rewritten in place each step.
    meta: Tensor,
    /// `[sequences, 3]`: the step's summaries, written by the step.
    summary: Tensor,
    graph: Option<Graph>,
}

/// Writes values into a u32 tensor in place (an upload into memory a graph reads).
struct Upload<'a>(&'a [u32]);

impl InplaceOp1 for Upload<'_> {
    fn name(&self) -> &'static str {
        "upload"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        match s {
            CpuStorage::U32(v) => v[l.start_offset()..][..self.0.len()].copy_from_slice(self.0),
            _ => candle_core::bail!("upload: not a u32 tensor"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        let dev = s.device().clone();
        let mut dst = s
            .as_cuda_slice_mut::<u32>()?
            .slice_mut(l.start_offset()..l.start_offset() + self.0.len());
        dev.memcpy_htod(self.0, &mut dst)
    }
}

impl GenericModel {
    /// A greedy decode step (one token and one summary-only row per sequence) in its bucket.
    pub(super) fn replayed_step(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut DeviceKv,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(), ModelError> {
        let Some(mut graphs) = kv.graphs.take() else {
            return Err(ModelError::Unsupported("no step graphs on this K/V".into()));
        };
        let result = self.in_bucket(chunks, kv, &mut graphs, summaries);
        kv.graphs = Some(graphs);
        result
    }

    fn in_bucket(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &DeviceKv,
        graphs: &mut StepGraphs,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(), ModelError> {
        let real = chunks.len();
        let batch = real.next_power_of_two();
        let widest = chunks.iter().map(|ch| ch.blocks.len()).max().unwrap_or(1);
        let step = StepMeta {
            n: batch,
            max_blocks: widest.next_power_of_two(),
            block_size: kv.block_size(),
        };
        let meta = self.padded_meta(chunks, step, kv.scratch_block())?;
        let ops = &self.ops;
        let key = (batch, step.max_blocks);
        match graphs.buckets.get_mut(&key) {
            Some(bucket) => {
                bucket.meta.inplace_op1(&Upload(&meta))?;
                ops.copies(1);
                match &bucket.graph {
                    Some(g) => {
                        g.launch()?;
                        ops.graphs(1);
                    }
                    None => self.fill(bucket, step, kv)?,
                }
            }
            None => {
                let len = meta.len();
                let bucket = Bucket {
                    meta: Tensor::from_vec(meta, len, &self.device)?,
                    summary: Tensor::zeros((batch, 3), DType::F32, &self.device)?,
                    graph: None,
                };
                ops.copies(1);
                if graphs.capture && !graphs.warmed {
                    self.grow_scratch(graphs.max_step_tokens)?;
                    graphs.warmed = true;
                }
                // The eager run with the parameter cache on, so that the capture finds every small
                // upload candle makes already on the device.
                self.eager_before_capture(&bucket, step, kv, graphs.capture)?;
                let bucket = graphs.buckets.entry(key).or_insert(bucket);
                if graphs.capture {
                    bucket.graph = self.capture(bucket, step, kv);
                }
            }
        }
        let bucket = &graphs.buckets[&key];
        ops.copies(1);
        summaries.extend(from_device(&bucket.summary.narrow(0, 0, real)?)?);
        Ok(())
    }

    /// The step's work into the bucket's summary tensor.
    fn fill(&self, bucket: &Bucket, step: StepMeta, kv: &DeviceKv) -> Result<(), ModelError> {
        let out = self.run(&bucket.meta, step, Sampled::Every, false, kv)?;
        self.ops.kernels(2);
        let s = out.apply_op1_no_bwd(&super::ops::Summarize)?;
        bucket.summary.slice_set(&s, 0, 0)?;
        Ok(())
    }

    /// `ids | pos | seq | tables` of `step.n` rows: the chunks', then padding rows decoding
    /// token 0 at position 0 into `scratch`.
    fn padded_meta(
        &self,
        chunks: &[SeqChunk<'_>],
        step: StepMeta,
        scratch: u32,
    ) -> Result<Vec<u32>, ModelError> {
        let pad = step.n - chunks.len();
        let mut meta = Vec::with_capacity(3 * step.n + step.n * step.max_blocks);
        for ch in chunks {
            self.check_chunk(ch, step.block_size)?;
            meta.push(ch.tokens[0]);
        }
        meta.extend(std::iter::repeat_n(0, pad));
        meta.extend(chunks.iter().map(|ch| ch.start_pos as u32));
        meta.extend(std::iter::repeat_n(0, pad));
        meta.extend(0..step.n as u32);
        for ch in chunks {
            meta.extend_from_slice(ch.blocks);
            meta.extend(std::iter::repeat_n(0, step.max_blocks - ch.blocks.len()));
        }
        for _ in 0..pad {
            meta.push(scratch);
            meta.extend(std::iter::repeat_n(0, step.max_blocks - 1));
        }
        Ok(meta)
    }

    /// The bucket's first step, run now; where it will be captured, with candle's cache of small
    /// uploads on (CUDA).
    fn eager_before_capture(
        &self,
        bucket: &Bucket,
        step: StepMeta,
        kv: &DeviceKv,
        capture: bool,
    ) -> Result<(), ModelError> {
        #[cfg(feature = "cuda")]
        let _cache = match (&self.device, capture) {
            (candle_core::Device::Cuda(dev), true) => Some(dev.enable_cuda_graph_htod_cache()),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = capture;
        self.fill(bucket, step, kv)
    }

    /// Grows the scratch memory of candle's quantized products to what a step of `tokens` needs
    /// (the matrix-vector kernels' up to 8 rows, the tiled kernels' beyond), through the widest
    /// product, so it never moves under a captured graph.
    fn grow_scratch(&self, tokens: usize) -> Result<(), ModelError> {
        let Some(widest) = self.widest_product() else {
            return Ok(());
        };
        let cols = widest.cols();
        for rows in [8.min(tokens), tokens] {
            let x = Tensor::zeros((rows.max(1), cols), DType::F32, &self.device)?;
            widest.forward(&x, false, &self.ops)?;
        }
        Ok(())
    }

    /// Captures the bucket's step (already run once eagerly, so every lazily made buffer and
    /// cached parameter exists); `None`, logged, where it cannot be.
    #[cfg(feature = "cuda")]
    fn capture(&self, bucket: &Bucket, step: StepMeta, kv: &DeviceKv) -> Option<Graph> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let candle_core::Device::Cuda(dev) = &self.device else {
            return None;
        };
        let before = self.ops.count();
        let stream = dev.cuda_stream();
        let captured = (|| -> Result<Graph, String> {
            let _cache = dev.enable_cuda_graph_htod_cache();
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| e.to_string())?;
            let work = self.fill(bucket, step, kv);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            work.map_err(|e| e.to_string())?;
            let graph = graph
                .map_err(|e| e.to_string())?
                .ok_or("the capture recorded nothing")?;
            graph.upload().map_err(|e| e.to_string())?;
            Ok(Graph(graph))
        })();
        // Capturing records the work without running it.
        self.ops.discount(self.ops.count().since(before));
        match captured {
            Ok(g) => {
                tracing::info!(
                    sequences = step.n,
                    blocks = step.max_blocks,
                    "captured a decode step's CUDA graph"
                );
                Some(g)
            }
            Err(e) => {
                tracing::warn!(
                    sequences = step.n,
                    blocks = step.max_blocks,
                    error = %e,
                    "cannot capture a decode step's CUDA graph; this shape runs eagerly"
                );
                None
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn capture(&self, _: &Bucket, _: StepMeta, _: &DeviceKv) -> Option<Graph> {
        None
    }
}

/// A captured decode step.
#[cfg(feature = "cuda")]
struct Graph(candle_core::cuda_backend::cudarc::driver::CudaGraph);

// SAFETY: a graph is captured, launched and destroyed on the engine thread, the one thread that
// runs steps on its K/V store; `Send` only lets that store (made empty of graphs on the thread
// that starts the engine) move to the engine thread. CUDA graph handles belong to the context,
// not to a thread.
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}

#[cfg(feature = "cuda")]
impl Graph {
    fn launch(&self) -> Result<(), ModelError> {
        self.0
            .launch()
            .map_err(|e| candle_core::Error::Msg(format!("launching a decode step's graph: {e}")))
            .map_err(ModelError::from)
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

/// Without CUDA there is nothing to capture.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Graph {}

#[cfg(not(feature = "cuda"))]
impl Graph {
    fn launch(&self) -> Result<(), ModelError> {
        match *self {}
    }
}
