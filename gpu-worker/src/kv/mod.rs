//! KV memory: a fixed budget of token blocks ([`BlockAllocator`]: reference counts, the prefix
//! cache of full blocks keyed by a chained hash of their tokens, LRU reuse of unreferenced ones)
//! the paged K/V storage ([`KvStore`], f32, f16 or int8), and the disk tier that evicted
//! sessions spill to ([`DiskTier`]).
//!
//! Every sequence (and every idle session cache) owns a block table: block `i` of the table holds
//! the K and V vectors of its tokens `i*block_size .. (i+1)*block_size` for every layer. Once the
//! sliding-window layers can no longer see a run of old blocks, their global layers are packed
//! into one block and the table's entries become [`NO_BLOCK`] (see [`Packing`]). Accounting
//! is exact: a block is free, cached (unreferenced but still holding a known prefix, reclaimed
//! least-recently-released first) or used (referenced by at least one table).

mod alloc;
mod disk;
mod store;

pub use alloc::{chain_hash, user_root, BlockAllocator, Chain, ROOT_HASH};
pub use disk::{DiskTier, Spilled};
pub use store::{KvDtype, KvStore, Packing};

/// Index of a block in the store.
pub type BlockId = u32;

/// A table entry whose block was packed away (see [`Packing`]): its positions are held, global
/// layers only, by the table's packed blocks. Never a reference to a block.
pub const NO_BLOCK: BlockId = BlockId::MAX;
