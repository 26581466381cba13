//! Intel AMX (Sapphire Rapids and later): whether this CPU has int8 tiles, and whether Linux
//! lets this process use them. A process must ask for the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) before any of its threads runs a tile
//! instruction; a thread that does so without it is killed with an illegal instruction. The
//! worker asks once, at start, before its kernel threads exist ([`amx`]), and reports the
//! answer in its device description, its log and the bench JSON.
//!
//! Where it is granted, products of many activation rows (prefill, batched decode) run on the
//! tiles ([`kernel`]), written once over a small interface to the few tile instructions used
//! ([`tiles::Tiles`]) with two implementations: the instructions, and a plain-Rust model of them
//! ([`model::Model`]). Packing, tiling, edge cases and scales are the same code for both, so the
//! tests prove the kernel bit for bit against the VNNI kernel through the model on any x86
//! machine with AVX-512, and through the instructions too where the CPU has them.

#[cfg(target_arch = "x86_64")]
pub mod kernel;
#[cfg(test)]
mod kernel_tests;
pub mod model;
pub mod tiles;

use std::fmt;
use std::sync::OnceLock;

/// What this process may do with AMX.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Amx {
    /// The CPU has no AMX int8 tiles (or this is not x86-64 Linux).
    Absent,
    /// The CPU has them, but the kernel refused the tile state (why, as the kernel said).
    Refused(String),
    /// This process may use the tiles, on every thread.
    Granted,
}

impl fmt::Display for Amx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Absent => f.write_str("absent"),
            Self::Refused(why) => write!(f, "refused by the kernel ({why})"),
            Self::Granted => f.write_str("granted"),
        }
    }
}

/// AMX here, asking Linux for the tile state the first time (call it before any kernel thread
/// starts).
pub fn amx() -> &'static Amx {
    static AMX: OnceLock<Amx> = OnceLock::new();
    AMX.get_or_init(request)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request() -> Amx {
    /// `arch_prctl` request for permission to use an extended state component.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// The AMX tile data state component.
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    if !has_amx_int8() {
        return Amx::Absent;
    }
    // SAFETY: arch_prctl with an integer request and argument; it touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if rc == 0 {
        Amx::Granted
    } else {
        Amx::Refused(std::io::Error::last_os_error().to_string())
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request() -> Amx {
    Amx::Absent
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (EDX bit 25).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn has_amx_int8() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only when the CPU has it.
    let (max_leaf, edx) = unsafe {
        let max = __cpuid(0).eax;
        (max, if max >= 7 { __cpuid_count(7, 0).edx } else { 0 })
    };
    max_leaf >= 7 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_is_found_where_the_cpu_lists_it_and_only_there() {
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let listed = cpuinfo.contains(" amx_int8") && cpuinfo.contains(" amx_tile");
        let found = amx();
        if listed {
            assert_ne!(*found, Amx::Absent, "/proc/cpuinfo lists amx_int8");
        } else {
            assert_eq!(*found, Amx::Absent, "/proc/cpuinfo lists no amx_int8");
        }
        // Asking again answers the same, without a second request.
        assert!(std::ptr::eq(found, amx()));
    }
}
