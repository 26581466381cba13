//! Device selection and memory reporting: the one place that knows which device the worker runs
//! on. Everything device-specific (the `cuda` feature included) stays behind this module.
//!
//! On the CPU the model runs on Hearth's own kernels. A `cuda` build opens `cuda:N` through
//! candle, reads the device's name, compute capability and memory from the driver, and the model
//! runs on it through the device-generic forward pass ([`crate::generic`]). One worker serves
//! one GPU: a machine with several runs one worker per `--device cuda:N`.

use std::fmt;
use std::str::FromStr;

use crate::kernels::{amx, kernel_isa, Isa};

/// Device memory as the worker reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUse {
    pub used_bytes: u64,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// What `--device` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The first GPU where this build has CUDA support and the driver finds one, else the CPU.
    Auto,
    Cpu,
    Cuda(u32),
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| DeviceError::BadSpec(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("device: expected `auto`, `cpu` or `cuda:N`, got `{0}`")]
    BadSpec(String),
    #[error("device: cuda:{0} requested, but this hearth-worker was built without CUDA support (rebuild with `--features cuda`)")]
    NoCudaSupport(u32),
    #[error("device: cuda:{ordinal} is not usable: {reason}")]
    CudaUnavailable { ordinal: u32, reason: String },
    #[error("device: cannot read cuda:{ordinal}'s free memory: {reason} (pass --kv-budget)")]
    MemoryUnknown { ordinal: u32, reason: String },
}

/// The device the model runs on.
#[derive(Clone, Debug)]
pub struct Device {
    /// `cpu` or `cuda`.
    pub kind: &'static str,
    pub ordinal: u32,
    /// For people: the GPU's name, or the CPU model and the kernel instruction set in use.
    pub name: String,
    /// `major.minor` on CUDA devices.
    pub compute_capability: Option<String>,
    /// The candle device tensors live on (the CPU for Hearth's kernels).
    pub candle: candle_core::Device,
}

/// Opens the requested device.
pub fn select(spec: DeviceSpec) -> Result<Device, DeviceError> {
    match spec {
        DeviceSpec::Auto => Ok(first_gpu().unwrap_or_else(cpu)),
        DeviceSpec::Cpu => Ok(cpu()),
        DeviceSpec::Cuda(n) => open_cuda(n),
    }
}

/// `cuda:0`, where this build has CUDA support and the driver opens it.
#[cfg(feature = "cuda")]
fn first_gpu() -> Option<Device> {
    match open_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            tracing::info!(error = %e, "no usable GPU; running on the CPU");
            None
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn first_gpu() -> Option<Device> {
    None
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: u32) -> Result<Device, DeviceError> {
    let unusable = |reason: String| DeviceError::CudaUnavailable { ordinal, reason };
    // One stream for everything on this device: weights are uploaded on the loader thread, the
    // K/V memory is allocated and zeroed on another, and the forward pass runs on the engine
    // thread. candle's default (`Device::new_cuda`) gives each thread its own per-thread default
    // stream, and nothing would order those; on one stream, work runs in the order it is issued.
    let cuda = candle_core::CudaDevice::new_with_stream(ordinal as usize)
        .map_err(|e| unusable(e.to_string()))?;
    // SAFETY: every tensor of this device lives on its one stream, so the per-tensor CUDA events
    // that order uses across streams order nothing here; without them each operation issues
    // fewer driver calls, and a step can be captured in a CUDA graph.
    unsafe { cuda.disable_event_tracking() };
    let candle = candle_core::Device::Cuda(cuda);
    let ctx = cuda_context(&candle).map_err(unusable)?;
    let name = ctx.name().map_err(|e| unusable(e.to_string()))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| unusable(e.to_string()))?;
    Ok(Device {
        kind: "cuda",
        ordinal,
        name,
        compute_capability: Some(format!("{major}.{minor}")),
        candle,
    })
}

#[cfg(feature = "cuda")]
fn cuda_context(
    d: &candle_core::Device,
) -> Result<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>, String> {
    let cuda = d.as_cuda_device().map_err(|e| e.to_string())?;
    Ok(cuda.cuda_stream().context().clone())
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: u32) -> Result<Device, DeviceError> {
    Err(DeviceError::NoCudaSupport(ordinal))
}

fn cpu() -> Device {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let isa = match kernel_isa() {
        Isa::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "avx2",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => "avx512-vnni",
        #[cfg(target_arch = "x86_64")]
        Isa::Amx => "amx + avx512-vnni",
    };
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    Device {
        kind: "cpu",
        ordinal: 0,
        name: format!("{model} ({isa}, {threads} threads, AMX {})", amx()),
        compute_capability: None,
        candle: candle_core::Device::Cpu,
    }
}

impl Device {
    /// Memory in use, free and in total. On the CPU: this process's resident set, available
    /// memory and physical memory; on CUDA the device's, from the driver (zeros, logged, if
    /// the driver cannot say: never the host's figures in a GPU's place).
    pub fn memory(&self) -> MemoryUse {
        if !self.is_gpu() {
            return MemoryUse {
                used_bytes: rss_bytes() as u64,
                free_bytes: proc_kb("/proc/meminfo", "MemAvailable:")
                    .map_or(0, |kb| kb as u64 * 1024),
                total_bytes: meminfo_total_bytes(),
            };
        }
        self.gpu_memory().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "device memory unknown");
            MemoryUse::default()
        })
    }

    /// Free device memory, to size the K/V budget from: an error, not a guess, if the driver
    /// cannot tell.
    pub fn free_bytes(&self) -> Result<u64, DeviceError> {
        if self.is_gpu() {
            self.gpu_memory().map(|m| m.free_bytes)
        } else {
            Ok(self.memory().free_bytes)
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_memory(&self) -> Result<MemoryUse, DeviceError> {
        let unknown = |reason: String| DeviceError::MemoryUnknown {
            ordinal: self.ordinal,
            reason,
        };
        let (free, total) = cuda_context(&self.candle)
            .map_err(unknown)?
            .mem_get_info()
            .map_err(|e| unknown(e.to_string()))?;
        Ok(MemoryUse {
            used_bytes: (total - free) as u64,
            free_bytes: free as u64,
            total_bytes: total as u64,
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn gpu_memory(&self) -> Result<MemoryUse, DeviceError> {
        Err(DeviceError::NoCudaSupport(self.ordinal))
    }

    /// Whether the model runs on a GPU (through the device-generic forward pass).
    pub fn is_gpu(&self) -> bool {
        self.kind != "cpu"
    }
}

/// Resident set size of this process, in bytes.
pub fn rss_bytes() -> usize {
    proc_kb("/proc/self/status", "VmRSS:").map_or(0, |kb| kb * 1024)
}

/// The most resident memory the process has had (the kernel's high-water mark, `VmHWM`).
pub fn peak_rss_bytes() -> usize {
    proc_kb("/proc/self/status", "VmHWM:").map_or(0, |kb| kb * 1024)
}

fn meminfo_total_bytes() -> u64 {
    proc_kb("/proc/meminfo", "MemTotal:").map_or(0, |kb| kb as u64 * 1024)
}

/// A `Name: N kB` line of a /proc file.
fn proc_kb(path: &str, key: &str) -> Option<usize> {
    let s = std::fs::read_to_string(path).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_bad_ones_are_named() {
        assert_eq!("auto".parse(), Ok(DeviceSpec::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda:1".parse(), Ok(DeviceSpec::Cuda(1)));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        for bad in ["gpu", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<DeviceSpec>().expect_err(bad);
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
    }

    #[test]
    fn cpu_reports_memory() {
        let d = select(DeviceSpec::Cpu).expect("cpu");
        assert_eq!(d.kind, "cpu");
        let m = d.memory();
        assert!(m.used_bytes > 0 && m.total_bytes > m.used_bytes, "{m:?}");
        assert!(m.free_bytes > 0 && m.free_bytes <= m.total_bytes, "{m:?}");
        assert_eq!((d.compute_capability.as_deref(), d.is_gpu()), (None, false));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let err = select(DeviceSpec::Cuda(0)).expect_err("no cuda");
        assert!(err.to_string().contains("--features cuda"), "{err}");
    }
}
