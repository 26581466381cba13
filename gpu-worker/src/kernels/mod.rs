//! CPU matrix kernels for 8-bit block-quantized weights, written for batch reuse.
//!
//! candle's CPU path for Q8_0/Q5_0 weights computes one activation row at a time, so every weight
//! block is read from memory once per row of the batch; for the 262k-row output projection that
//! makes batched decode no faster per row than single-stream decode. Here each weight block is
//! loaded once per tile of activation rows. Q5_0 weights are widened to the same signed 8-bit
//! layout at load (exact: values fit in `i8`) and other block formats re-quantized into it, so one
//! kernel serves every matrix.
//!
//! Dispatch picks the widest instruction set the CPU has at run time (AVX-512 VNNI, AVX2, or
//! portable scalar code); every path is tested against the scalar reference and against candle.
//! Where AVX-512 VNNI runs, the model's matrices are loaded into the panel layout
//! ([`for_this_cpu`], [`panels`]), whose kernel spends about a third of the row kernel's vector
//! operations per multiply-add. There and under AVX2, Q5_0 matrices are also read in 5 bits and
//! Q4_K and Q6_K matrices as they are ([`to_five_bit`], [`k_quant_for_this_cpu`]), so a decode
//! step reads as many bytes as the file holds; AVX2 keeps 8-bit matrices row-major (its panel
//! kernel takes values of at most 6 bits), and portable code keeps every matrix so.

mod amx;
mod panels;
mod pool;
mod q8;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use amx::{amx, Amx};
#[cfg(target_arch = "x86_64")]
pub use amx::{model::Model as TileModel, tiles::Hardware as TileInstructions};
pub use panels::{from_q4_k, from_q6_k, to_five_bit, to_panels, PANEL, QK_K};
pub use pool::SpinPool;
pub use q8::{
    advise_huge_pages, pack_into_arena, quantize_activations, ActQ8, Layout, LayoutError, Q8Matrix,
    Values, QK,
};

/// Parallel tasks per thread: a few, so uneven progress between threads evens out.
const TASKS_PER_THREAD: usize = 4;
/// Least work per task (multiply-adds): below this, scheduling costs more than it saves.
const MIN_TASK_WORK: usize = 1 << 18;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX-512 VNNI's panels, whose products of [`AMX_MIN_ROWS`] activation rows or more run on
    /// AMX tiles (bit for bit the VNNI kernel's results), but for Q6_K matrices: scaled each 16
    /// values, they take two tile products a block, and measured slower there than on VNNI.
    #[cfg(target_arch = "x86_64")]
    Amx,
}

impl Isa {
    /// Whether the AVX-512 VNNI kernels run (alone, or beside the AMX one).
    pub fn has_vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return matches!(self, Isa::Avx512Vnni | Isa::Amx);
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
}

/// Fewest activation rows whose products run on AMX tiles; fewer run on the VNNI kernel (the
/// same results), which reads the weights as fast where a product is bound by reading them.
pub const AMX_MIN_ROWS: usize = 12;

/// The best kernel this CPU can run (asking Linux for AMX's tile state the first time).
pub fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
        {
            if *amx() == Amx::Granted {
                return Isa::Amx;
            }
            return Isa::Avx512Vnni;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The kernels the model runs with: chosen once ([`use_kernels`]), else the best here.
static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();

fn cached_isa() -> Isa {
    *ISA.get_or_init(detect_isa)
}

/// The kernels this process runs (what [`use_kernels`] chose, else the best this CPU has).
pub fn kernel_isa() -> Isa {
    cached_isa()
}

/// `--kernels`: which CPU kernels run, for comparing them (`auto`: the best this CPU has).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KernelChoice {
    #[default]
    Auto,
    /// AMX tiles for products of many rows, AVX-512 VNNI for the rest (panels).
    Amx,
    /// AVX-512 VNNI (panels).
    Vnni,
    Avx2,
    /// Portable code.
    Scalar,
}

/// The kernels `choice` names on a CPU whose best is `best`, or why they cannot run there.
pub fn pick(choice: KernelChoice, best: Isa) -> Result<Isa, String> {
    #[cfg(target_arch = "x86_64")]
    let (amx_tiles, vnni, avx2) = (
        (best == Isa::Amx).then_some(Isa::Amx),
        best.has_vnni().then_some(Isa::Avx512Vnni),
        (best != Isa::Scalar).then_some(Isa::Avx2),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (amx_tiles, vnni, avx2) = (None, None, None);
    let lacks =
        |what: &str| format!("this CPU lacks {what} (the best kernels it runs are {best:?})");
    match choice {
        KernelChoice::Auto => Ok(best),
        KernelChoice::Scalar => Ok(Isa::Scalar),
        KernelChoice::Amx => amx_tiles.ok_or_else(|| match amx() {
            Amx::Refused(why) => format!(
                "Linux refused this process AMX's tile state ({why}); the best kernels here are \
                 {best:?}"
            ),
            _ => lacks("AMX int8 tiles with AVX-512 VNNI"),
        }),
        KernelChoice::Vnni => vnni.ok_or_else(|| lacks("AVX-512 VNNI")),
        KernelChoice::Avx2 => avx2.ok_or_else(|| lacks("AVX2 and FMA")),
    }
}

/// Runs the kernels `choice` names from now on; call it before any model is loaded (the
/// weights are laid out for the kernels). Also asks for AMX's tile state ([`amx`]) while no
/// kernel thread exists yet. Returns the kernels chosen.
pub fn use_kernels(choice: KernelChoice) -> Result<Isa, String> {
    let isa = pick(choice, detect_isa())?;
    let amx = amx();
    let set = *ISA.get_or_init(|| isa);
    if set != isa {
        return Err(format!(
            "the {set:?} kernels already run in this process; {isa:?} cannot replace them"
        ));
    }
    tracing::info!(kernels = ?isa, %amx, "CPU kernels chosen");
    Ok(isa)
}

/// Whether AVX-512 F and BW run here: the activation quantizer's and attention's fast paths.
/// (`is_x86_feature_detected!` caches what it finds.)
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// `m` in the layout this CPU's kernels read fastest: panels where AVX-512 VNNI runs, five-bit
/// panels for values that fit where AVX2 does, rows elsewhere.
pub fn for_this_cpu(m: Q8Matrix) -> Q8Matrix {
    if m.layout != Layout::Rows {
        return m;
    }
    match cached_isa() {
        isa if isa.has_vnni() => to_panels(&m).unwrap_or(m),
        // The AVX2 panel kernel takes values of at most 6 bits: five-bit panels where they fit
        // (GGUF's Q5_0), rows otherwise.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if fits_five_bits(&m) => to_panels(&m).and_then(|p| to_five_bit(&p)).unwrap_or(m),
        _ => m,
    }
}

/// A GGUF Q8_0 or Q5_0 matrix (`None` for other formats) in the layout this CPU's kernel reads,
/// read from the file's bytes where they lie: straight into panels where the panel kernel takes
/// the format (AVX-512 VNNI; AVX2 for Q5_0's five-bit values), without the row layout in
/// between, else through it. Either way the same matrix as [`for_this_cpu`] and [`to_five_bit`]
/// make of [`Q8Matrix::from_q8_0`] or [`Q8Matrix::from_q5_0`].
pub fn blocks_for_this_cpu(
    dtype: candle_core::quantized::GgmlDType,
    rows: usize,
    cols: usize,
    data: &[u8],
) -> Option<Result<Q8Matrix, LayoutError>> {
    use candle_core::quantized::GgmlDType;
    let (format, bytes, decode): (&str, usize, q8::Decode) = match dtype {
        GgmlDType::Q8_0 => ("Q8_0", q8::Q8_0_BYTES, q8::q8_0_block),
        GgmlDType::Q5_0 => ("Q5_0", q8::Q5_0_BYTES, q8::q5_0_block),
        _ => return None,
    };
    let direct = match cached_isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => dtype == GgmlDType::Q5_0,
        Isa::Scalar => false,
    };
    let m = if direct {
        Q8Matrix::check(format, rows, cols, data.len(), bytes)
            .map(|()| panels::panels_from_blocks(rows, cols, data, bytes, decode))
    } else if dtype == GgmlDType::Q8_0 {
        Q8Matrix::from_q8_0(rows, cols, data).map(for_this_cpu)
    } else {
        Q8Matrix::from_q5_0(rows, cols, data).map(for_this_cpu)
    };
    Some(m.map(|m| to_five_bit(&m).unwrap_or(m)))
}

#[cfg(target_arch = "x86_64")]
/// Whether every value of a row-layout matrix lies in `[-16, 15]`.
fn fits_five_bits(m: &Q8Matrix) -> bool {
    use rayon::prelude::*;
    m.qs.par_iter().all(|v| (-16..16).contains(v))
}

/// A GGUF Q4_K or Q6_K matrix in the layout this CPU's kernel reads as it is (Q4_K or Q6_K panels,
/// where AVX-512 VNNI or AVX2 runs); `None` for other formats or where there is none, and the
/// caller re-quantizes it to 8-bit blocks.
pub fn k_quant_for_this_cpu(
    dtype: candle_core::quantized::GgmlDType,
    rows: usize,
    cols: usize,
    data: &[u8],
) -> Option<Result<Q8Matrix, String>> {
    use candle_core::quantized::GgmlDType;
    if cached_isa() == Isa::Scalar || !cols.is_multiple_of(QK_K) {
        return None;
    }
    match dtype {
        GgmlDType::Q4K => Some(panels::from_q4_k(rows, cols, data)),
        GgmlDType::Q6K => Some(panels::from_q6_k(rows, cols, data)),
        _ => None,
    }
}

/// A pointer to the output that parallel tasks write through; each task owns disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (row, column) cells of one live buffer; see `matmul_q8_with`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Taking `self` makes closures capture the whole (Send) wrapper, not its raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[m][n] = x[m] · w[n]` for every activation row `m` and weight row `n`.
/// `out` has `x.rows * w.rows` elements, row-major by activation row.
pub fn matmul_q8(w: &Q8Matrix, x: &ActQ8, out: &mut [f32]) {
    matmul_q8_with(cached_isa(), w, x, out)
}

pub fn matmul_q8_with(isa: Isa, w: &Q8Matrix, x: &ActQ8, out: &mut [f32]) {
    matmul_tasks(isa, w, x, out, None)
}

/// What a task of [`matmul_q8_then`] does with its outputs while they are still in cache: it gets
/// the task's output columns and, for each activation row in order, that row's values in them.
pub type Then<'a> = &'a (dyn Fn(std::ops::Range<usize>, &mut [&mut [f32]]) + Sync);

/// [`matmul_q8`], whose tasks each hand their outputs to `then` as soon as they are computed.
/// Tasks cover whole multiples of `piece` output columns (itself a multiple of [`PANEL`]), fewer
/// of them the more rows there are, so a task's outputs stay in cache for `then`; a task's first
/// column is always a multiple of `piece`, whatever the batch.
pub fn matmul_q8_then(w: &Q8Matrix, x: &ActQ8, out: &mut [f32], piece: usize, then: Then<'_>) {
    matmul_tasks(cached_isa(), w, x, out, Some((piece, then)))
}

fn matmul_tasks(
    isa: Isa,
    w: &Q8Matrix,
    x: &ActQ8,
    out: &mut [f32],
    then: Option<(usize, Then<'_>)>,
) {
    assert_eq!(w.cols, x.cols, "weight and activation widths differ");
    let panels = w.layout != Layout::Rows;
    // The VNNI row kernel's per-activation vectors, made once here rather than by every task.
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only for the VNNI kernel, which `detect_isa` (or the caller, in tests) checked.
    let prepared = (!panels && isa.has_vnni()).then(|| unsafe { x86::vnni512::prepare(x) });
    let kernel = |r0: usize, r1: usize, out: &mut [f32]| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect_isa` (or the caller, in tests) checked the CPU features, and chose
        // AMX only where Linux granted the tile state.
        Isa::Amx if panels && x.rows >= AMX_MIN_ROWS && w.layout != Layout::PanelsQ6K => unsafe {
            let mut tiles = TileInstructions::new().expect("AMX is chosen only where granted");
            amx::kernel::matmul_rows(&mut tiles, w, x, r0, r1, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect_isa` (or the caller, in tests) checked the CPU features.
        Isa::Avx512Vnni | Isa::Amx if panels => unsafe {
            panels::vnni512::matmul_rows(w, x, r0, r1, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if panels && panels::avx2::takes(w.layout) => unsafe {
            panels::avx2::matmul_rows(w, x, r0, r1, out)
        },
        _ if panels => panels::matmul_rows_scalar(w, x, r0, r1, out),
        Isa::Scalar => q8::matmul_rows_scalar(w, x, r0, r1, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::avx2::matmul_rows(w, x, r0, r1, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512Vnni | Isa::Amx => unsafe {
            let px = prepared.as_ref().expect("prepared above for this kernel");
            x86::vnni512::matmul_rows(w, x, px, r0, r1, out)
        },
    };
    run_tasks(w, x, out, then, &kernel);
}

/// A kernel's work on one task: output columns `r0..r1` of every activation row, into the whole
/// output.
type Kernel<'a> = &'a (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// `kernel` over the pool's tasks, each owning whole panels' output columns (whole pieces, when
/// `then` is given, which each task calls on its own outputs).
fn run_tasks(
    w: &Q8Matrix,
    x: &ActQ8,
    out: &mut [f32],
    then: Option<(usize, Then<'_>)>,
    kernel: Kernel<'_>,
) {
    assert_eq!(out.len(), w.rows * x.rows, "output has the wrong size");
    let n = w.rows;
    let ptr = OutPtr(out.as_mut_ptr());
    let pool = SpinPool::global();
    let threads = pool.threads();
    let panels = w.layout != Layout::Rows;
    let per_task = match then {
        // Whole pieces: as many as keep a task's outputs near 32 KiB, and at least one.
        Some((piece, _)) => {
            assert!(
                piece > 0 && piece.is_multiple_of(PANEL),
                "pieces are whole panels"
            );
            piece * (8192 / (piece * x.rows.max(1))).max(1)
        }
        None => {
            let work = n * w.cols * x.rows.max(1);
            // As many tasks as the work justifies, up to a few per thread, and a multiple of the
            // thread count so no thread is left finishing a last task alone.
            let mut tasks = (work / MIN_TASK_WORK).clamp(1, threads * TASKS_PER_THREAD);
            if tasks >= threads {
                tasks -= tasks % threads;
            }
            n.div_ceil(tasks)
                .next_multiple_of(if panels { PANEL } else { 4 })
        }
    };
    pool.run(n.div_ceil(per_task), &|t| {
        let r0 = t * per_task;
        let r1 = (r0 + per_task).min(n);
        // SAFETY: this task writes only columns r0..r1 of each output row, which no other task
        // touches, and `out` outlives the parallel loop.
        kernel(r0, r1, unsafe {
            std::slice::from_raw_parts_mut(ptr.get(), n * x.rows)
        });
        if let Some((_, then)) = then {
            let mut rows: Vec<&mut [f32]> = (0..x.rows)
                // SAFETY: columns r0..r1 of row m are this task's alone (as above), and the
                // kernel's borrow of `out` has ended.
                .map(|m| unsafe {
                    std::slice::from_raw_parts_mut(ptr.get().add(m * n + r0), r1 - r0)
                })
                .collect();
            then(r0..r1, &mut rows);
        }
    });
}

#[cfg(test)]
pub(crate) mod tests;
