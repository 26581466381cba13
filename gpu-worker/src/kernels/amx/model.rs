//! A plain-Rust model of the AMX instructions the kernels use ([`super::tiles`]), following
//! Intel's instruction set reference: what each instruction does to the tiles and to memory,
//! and the conditions under which the hardware would fault, which the model turns into panics
//! that say what was wrong.
//!
//! Tile state belongs to a thread, as on the hardware: a thread's first tile instruction needs a
//! configuration loaded on that same thread. The model keeps each thread's tiles in a
//! thread-local, so a kernel that configured its tiles on one thread and used them on another
//! fails here as it would on an AMX CPU.

use super::tiles::{TileConfig, Tiles, MAX_COLSB, MAX_ROWS, TILES};
use std::cell::RefCell;

/// One tile's 16 rows of 64 bytes.
type Tile = [[u8; MAX_COLSB]; MAX_ROWS];

/// A thread's tile registers and the configuration they were given.
struct State {
    config: Option<TileConfig>,
    tiles: [Tile; TILES],
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State { config: None, tiles: [[[0; MAX_COLSB]; MAX_ROWS]; TILES] })
    };
}

/// The model of the tile instructions, on this thread's tiles.
#[derive(Debug, Default)]
pub struct Model;

impl Model {
    /// Tile `t`'s shape, or a panic naming the instruction that used it unconfigured.
    fn shape(state: &State, t: u8, op: &str) -> (usize, usize) {
        let Some(config) = &state.config else {
            panic!("{op} on tmm{t}: this thread has loaded no tile configuration (#UD)");
        };
        let (rows, colsb) = config.shape(t);
        assert!(
            rows > 0 && colsb > 0,
            "{op} on tmm{t}: the tile is not configured (#UD)"
        );
        (rows, colsb)
    }
}

// SAFETY: each method does what the instruction it models does (the module's header), and
// touches memory only within the rows and bytes the tile's shape names.
unsafe impl Tiles for Model {
    unsafe fn configure(&mut self, config: &TileConfig) {
        assert_eq!(
            config.palette(),
            1,
            "LDTILECFG: palette {}",
            config.palette()
        );
        for t in 0..TILES as u8 {
            let (rows, colsb) = config.shape(t);
            assert!(
                rows <= MAX_ROWS && colsb <= MAX_COLSB && (rows == 0) == (colsb == 0),
                "LDTILECFG: tmm{t} of {rows} rows × {colsb} bytes (#GP)"
            );
        }
        STATE.with_borrow_mut(|s| {
            s.config = Some(*config);
            s.tiles = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
        });
    }

    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        STATE.with_borrow_mut(|s| {
            let (rows, colsb) = Self::shape(s, T, "TILELOADD");
            let tile = &mut s.tiles[usize::from(T)];
            for (r, row) in tile.iter_mut().enumerate() {
                *row = [0; MAX_COLSB];
                if r < rows {
                    // SAFETY: the caller's contract: row r can be read at src + r·stride.
                    let from = unsafe { std::slice::from_raw_parts(src.add(r * stride), colsb) };
                    row[..colsb].copy_from_slice(from);
                }
            }
        });
    }

    unsafe fn store<const T: u8>(&mut self, dst: *mut u8, stride: usize) {
        STATE.with_borrow(|s| {
            let (rows, colsb) = Self::shape(s, T, "TILESTORED");
            for (r, row) in s.tiles[usize::from(T)][..rows].iter().enumerate() {
                // SAFETY: the caller's contract: row r can be written at dst + r·stride.
                let to = unsafe { std::slice::from_raw_parts_mut(dst.add(r * stride), colsb) };
                to.copy_from_slice(&row[..colsb]);
            }
        });
    }

    unsafe fn zero<const T: u8>(&mut self) {
        STATE.with_borrow_mut(|s| {
            Self::shape(s, T, "TILEZERO");
            s.tiles[usize::from(T)] = [[0; MAX_COLSB]; MAX_ROWS];
        });
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        STATE.with_borrow_mut(|s| {
            let (c_rows, c_colsb) = Self::shape(s, C, "TDPBSUD");
            let (a_rows, a_colsb) = Self::shape(s, A, "TDPBSUD");
            let (b_rows, b_colsb) = Self::shape(s, B, "TDPBSUD");
            assert!(
                a_rows == c_rows && a_colsb == 4 * b_rows && b_colsb == c_colsb,
                "TDPBSUD tmm{C}, tmm{A}, tmm{B}: shapes {c_rows}×{c_colsb}, {a_rows}×{a_colsb}, \
                 {b_rows}×{b_colsb} do not chain (#UD)"
            );
            let (a, b) = (s.tiles[usize::from(A)], s.tiles[usize::from(B)]);
            let c = &mut s.tiles[usize::from(C)];
            for (m, c_row) in c.iter_mut().enumerate().take(c_rows) {
                for n in 0..c_colsb / 4 {
                    let cell = &mut c_row[4 * n..4 * n + 4];
                    let mut sum = i32::from_le_bytes([cell[0], cell[1], cell[2], cell[3]]);
                    for (k, b_row) in b.iter().enumerate().take(b_rows) {
                        for i in 0..4 {
                            let x = i32::from(a[m][4 * k + i] as i8);
                            let y = i32::from(b_row[4 * n + i]);
                            sum = sum.wrapping_add(x * y);
                        }
                    }
                    cell.copy_from_slice(&sum.to_le_bytes());
                }
                // The row's bytes past the configured columns are zeroed.
                c_row[c_colsb..].fill(0);
            }
            for row in &mut c[c_rows..] {
                *row = [0; MAX_COLSB];
            }
        });
    }

    fn release(&mut self) {
        STATE.with_borrow_mut(|s| {
            s.config = None;
            s.tiles = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
        });
    }
}
