//! The few AMX instructions the kernels use, behind one small trait ([`Tiles`]) with two
//! implementations: the instructions themselves ([`Hardware`], for CPUs that have them) and a
//! plain-Rust model of them ([`super::model::Model`], for every other x86 machine). The kernels
//! are written once over the trait, so everything but these few instructions runs, and is
//! tested bit for bit, on any machine with AVX-512.
//!
//! What the kernels need of AMX, as Intel's instruction set reference defines it:
//! - `LDTILECFG`: palette 1; each of the 8 tiles gets a number of rows (at most 16) and of bytes
//!   per row (at most 64). A thread must load a configuration before its first tile instruction.
//! - `TILELOADD` / `TILESTORED`: a tile's rows from or to memory, row `r` at `base + r·stride`.
//! - `TILEZERO`.
//! - `TDPBSUD c, a, b`: for each row `m` of `a` and each 4-byte column `n` of `b`,
//!   `c[m][n] += Σ_k Σ_i a[m][4k + i] · b[k][4n + i]`, `a`'s bytes signed and `b`'s unsigned,
//!   into wrapping 32-bit sums. `b` holds 4 consecutive values of each of its columns per row:
//!   exactly the panel layout's 64-byte groups ([`crate::kernels::PANEL`] weight rows × 4 values),
//!   whose weights are stored unsigned. So the panels are tiles as they lie in memory, and the
//!   activations, signed and row-major, are `a`.
//! - `TILERELEASE`: back to the initial state.

/// Tiles in palette 1.
pub const TILES: usize = 8;
/// Most rows of a tile.
pub const MAX_ROWS: usize = 16;
/// Most bytes of a tile's row.
pub const MAX_COLSB: usize = 64;

/// `LDTILECFG`'s 64-byte operand: byte 0 the palette, bytes 16.. each tile's bytes per row
/// (16 bits), bytes 48.. each tile's rows.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig([u8; 64]);

impl TileConfig {
    /// Palette 1 with every tile unused (no rows, no bytes).
    pub fn new() -> Self {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        TileConfig(bytes)
    }

    /// Tile `tile` as `rows × colsb` bytes.
    ///
    /// # Panics
    /// If the tile or the shape is out of palette 1's range, or `colsb` is not whole 4-byte
    /// elements (the kernels never ask for one).
    pub fn with(mut self, tile: u8, rows: usize, colsb: usize) -> Self {
        let t = usize::from(tile);
        assert!(t < TILES, "tile {tile}: palette 1 has {TILES}");
        assert!(
            (1..=MAX_ROWS).contains(&rows) && (4..=MAX_COLSB).contains(&colsb),
            "tile {tile}: {rows} rows of {colsb} bytes is outside palette 1's 16 × 64"
        );
        assert!(colsb.is_multiple_of(4), "tile {tile}: {colsb} bytes a row");
        self.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&(colsb as u16).to_le_bytes());
        self.0[48 + t] = rows as u8;
        self
    }

    /// The palette this configuration names.
    pub fn palette(&self) -> u8 {
        self.0[0]
    }

    /// Tile `tile`'s rows and bytes per row (0, 0 when unused).
    pub fn shape(&self, tile: u8) -> (usize, usize) {
        let t = usize::from(tile);
        let colsb = u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]);
        (usize::from(self.0[48 + t]), usize::from(colsb))
    }

    pub(super) fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
}

impl Default for TileConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The AMX instructions the kernels use. Tile numbers are const parameters, as the instructions
/// encode them.
///
/// # Safety
/// Implementations behave as the instructions do for every configuration and operand the
/// kernels pass. The methods are `unsafe` because the instructions read and write raw memory:
/// callers pass pointers to `rows` rows of `stride` bytes each, the tile's configured shape.
pub unsafe trait Tiles {
    /// `LDTILECFG`: this thread's tiles take `config`'s shapes, and their values are zeroed.
    ///
    /// # Safety
    /// `config` is valid for palette 1 (as [`TileConfig::with`] makes them).
    unsafe fn configure(&mut self, config: &TileConfig);

    /// `TILELOADD`: tile `T`'s rows from `src`, `stride` bytes apart.
    ///
    /// # Safety
    /// This thread configured tile `T`; each of its rows can be read at `src + r·stride`.
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize);

    /// `TILESTORED`: tile `T`'s rows to `dst`, `stride` bytes apart.
    ///
    /// # Safety
    /// This thread configured tile `T`; each of its rows can be written at `dst + r·stride`.
    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize);

    /// `TILEZERO`.
    ///
    /// # Safety
    /// This thread configured tile `T`.
    unsafe fn zero<const T: u8>(&mut self);

    /// `TDPBSUD c, a, b`: `c[m][n] += Σ a[m][4k + i] (signed) · b[k][4n + i] (unsigned)`.
    ///
    /// # Safety
    /// This thread configured the three tiles, `a`'s rows equal `c`'s, `a`'s bytes per row are
    /// four times `b`'s rows, and `b`'s bytes per row equal `c`'s.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);

    /// `TILERELEASE`: this thread's tiles return to their initial, unconfigured state.
    fn release(&mut self);
}

/// The instructions themselves. Only [`Hardware::new`] makes one, where Linux granted this
/// process the tile state.
#[derive(Debug)]
pub struct Hardware(());

impl Hardware {
    /// The tile instructions, where this CPU has them and this process may use them.
    pub fn new() -> Option<Self> {
        (*super::amx() == super::Amx::Granted).then_some(Hardware(()))
    }
}

// SAFETY: each method is the one instruction it names; `Hardware` exists only where the CPU has
// AMX-TILE and AMX-INT8 and Linux granted the tile state, so none of them faults on its own.
#[cfg(target_arch = "x86_64")]
unsafe impl Tiles for Hardware {
    unsafe fn configure(&mut self, config: &TileConfig) {
        // SAFETY: the caller passes a palette-1 configuration; 64 readable bytes.
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) config.as_ptr(), options(nostack)) };
    }

    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{src} + {stride} * 1]",
                t = const T, src = in(reg) src, stride = in(reg) stride,
                options(nostack, readonly, preserves_flags)
            )
        };
    }

    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tilestored [{dst} + {stride} * 1], tmm{t}",
                t = const T, dst = in(reg) dst, stride = in(reg) stride,
                options(nostack, preserves_flags)
            )
        };
    }

    unsafe fn zero<const T: u8>(&mut self) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!("tilezero tmm{t}", t = const T, options(nomem, nostack, preserves_flags))
        };
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tdpbsud tmm{c}, tmm{a}, tmm{b}",
                c = const C, a = const A, b = const B,
                options(nomem, nostack, preserves_flags)
            )
        };
    }

    fn release(&mut self) {
        // SAFETY: `Hardware` exists only where the tile state was granted; TILERELEASE takes
        // no operands and is valid whether or not tiles are configured.
        unsafe { std::arch::asm!("tilerelease", options(nostack)) };
    }
}
