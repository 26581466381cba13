//! The disk tier: session caches evicted from memory are written to a memory-mapped file and read
//! back when the session returns, instead of being recomputed.
//!
//! The file (`kv-tier.bin` under the configured directory) is created sparse at the configured
//! size and divided into slots of one KV block each (every layer's K and V of `block_size`
//! positions, in the store's element type). An index in memory maps each spilled session to its
//! tokens and slots; when the file is full, the least recently spilled sessions are dropped. The
//! file is scratch space: it is recreated at start-up and never read across restarts.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use hearth_shared::SessionId;

/// A shared, writable mapping of a whole file.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through `&self`/`&mut self`.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(file: &std::fs::File, len: usize) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of `len` bytes of an open file we sized to `len`; the
        // kernel picks the address. Checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, writable, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; no slice into it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One spilled session.
#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    /// Leading slots that hold packed blocks (see [`super::Packing`]).
    packed: usize,
    slots: Vec<u32>,
    stamp: u64,
}

/// What a restore hands back: the session's tokens and, per block, its stored bytes.
#[derive(Debug)]
pub struct Spilled<'a> {
    pub tokens: Vec<u32>,
    /// Leading blocks that are packed blocks.
    pub packed: usize,
    pub blocks: Vec<&'a [u8]>,
}

/// The file-backed session store.
#[derive(Debug)]
pub struct DiskTier {
    path: PathBuf,
    map: Mapping,
    slot_bytes: usize,
    free: Vec<u32>,
    entries: HashMap<SessionId, Entry>,
    clock: u64,
    /// Sessions dropped from the tier for room.
    pub dropped: usize,
}

impl DiskTier {
    /// Creates (or truncates) the tier's file under `dir`: `capacity` bytes, in slots of
    /// `slot_bytes`.
    pub fn create(dir: &Path, capacity: u64, slot_bytes: usize) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("kv-tier.bin");
        let slots = (capacity / slot_bytes.max(1) as u64).min(u32::MAX as u64) as usize;
        if slots == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{capacity} bytes hold no KV block of {slot_bytes} bytes"),
            ));
        }
        let len = slots * slot_bytes;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)?;
        file.set_len(len as u64)?;
        let map = Mapping::new(&file, len)?;
        Ok(Self {
            path,
            map,
            slot_bytes,
            free: (0..slots as u32).rev().collect(),
            entries: HashMap::new(),
            clock: 0,
            dropped: 0,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn sessions(&self) -> usize {
        self.entries.len()
    }

    pub fn slots_total(&self) -> usize {
        self.map.len / self.slot_bytes
    }

    pub fn slots_used(&self) -> usize {
        self.slots_total() - self.free.len()
    }

    pub fn contains(&self, id: &SessionId) -> bool {
        self.entries.contains_key(id)
    }

    /// Stores a session: `tokens`, and `blocks` whose bytes `fill(i, out)` writes for block `i`
    /// (exactly `slot_bytes` or fewer), the first `packed` of them packed blocks. Drops the
    /// oldest sessions for room; false when the session does not fit even in an empty tier.
    pub fn spill(
        &mut self,
        id: SessionId,
        tokens: Vec<u32>,
        packed: usize,
        blocks: usize,
        mut fill: impl FnMut(usize, &mut Vec<u8>),
    ) -> bool {
        self.remove(&id);
        if blocks > self.slots_total() {
            return false;
        }
        while self.free.len() < blocks {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.stamp)
                .map(|(k, _)| k.clone())
            else {
                return false;
            };
            self.remove(&oldest);
            self.dropped += 1;
        }
        let mut slots = Vec::with_capacity(blocks);
        let mut buf = Vec::with_capacity(self.slot_bytes);
        for i in 0..blocks {
            let Some(slot) = self.free.pop() else {
                break;
            };
            buf.clear();
            fill(i, &mut buf);
            let at = slot as usize * self.slot_bytes;
            let n = buf.len().min(self.slot_bytes);
            self.map.bytes_mut()[at..at + n].copy_from_slice(&buf[..n]);
            slots.push(slot);
        }
        self.clock += 1;
        self.entries.insert(
            id,
            Entry {
                tokens,
                packed,
                slots,
                stamp: self.clock,
            },
        );
        true
    }

    /// The tokens a spilled session holds, if it is here.
    pub fn tokens(&self, id: &SessionId) -> Option<&[u32]> {
        self.entries.get(id).map(|e| e.tokens.as_slice())
    }

    /// How many of a spilled session's leading blocks are packed blocks.
    pub fn packed(&self, id: &SessionId) -> Option<usize> {
        self.entries.get(id).map(|e| e.packed)
    }

    /// Takes a session out of the tier; its slots are free again once the returned view (which
    /// borrows the tier) is dropped.
    pub fn take(&mut self, id: &SessionId) -> Option<Spilled<'_>> {
        let e = self.entries.remove(id)?;
        self.free.extend(e.slots.iter().rev());
        let bytes = self.map.bytes();
        let sb = self.slot_bytes;
        Some(Spilled {
            tokens: e.tokens,
            packed: e.packed,
            blocks: e
                .slots
                .iter()
                .map(|&s| &bytes[s as usize * sb..(s as usize + 1) * sb])
                .collect(),
        })
    }

    pub fn remove(&mut self, id: &SessionId) -> bool {
        match self.entries.remove(id) {
            Some(e) => {
                self.free.extend(e.slots.iter().rev());
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_round_trip_and_the_oldest_make_room() {
        let dir = std::env::temp_dir().join(format!("hearth-disk-{}", std::process::id()));
        let mut t = DiskTier::create(&dir, 4 * 8, 8).unwrap();
        assert_eq!(t.slots_total(), 4);
        let fill = |tag: u8| move |i: usize, out: &mut Vec<u8>| out.extend([tag + i as u8; 8]);
        assert!(t.spill(SessionId::from("a"), vec![1, 2, 3], 0, 2, fill(10)));
        assert!(t.spill(SessionId::from("b"), vec![4], 1, 2, fill(20)));
        assert_eq!((t.sessions(), t.slots_used()), (2, 4));
        // A third session needs room: the oldest ("a") goes.
        assert!(t.spill(SessionId::from("c"), vec![5, 6], 0, 1, fill(30)));
        assert!(!t.contains(&SessionId::from("a")));
        assert_eq!(t.dropped, 1);
        assert!(!t.spill(SessionId::from("huge"), vec![], 0, 5, fill(0)));
        let b = t.take(&SessionId::from("b")).unwrap();
        assert_eq!((b.tokens.as_slice(), b.packed), (&[4][..], 1));
        assert_eq!(b.blocks, vec![&[20u8; 8][..], &[21u8; 8][..]]);
        drop(b);
        assert_eq!(t.slots_used(), 1);
        assert!(t.take(&SessionId::from("b")).is_none());
        assert!(t.path().is_file());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
