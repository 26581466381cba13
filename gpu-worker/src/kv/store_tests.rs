use super::*;

/// Pages of `v` the process has resident (`mincore`).
#[cfg(target_os = "linux")]
fn resident_bytes<T>(v: &[T]) -> usize {
    let page = 4096;
    let start = (v.as_ptr() as usize) & !(page - 1);
    let end = v.as_ptr() as usize + std::mem::size_of_val(v);
    let mut map = vec![0u8; (end - start).div_ceil(page)];
    // SAFETY: the range covers one live allocation (rounded out to whole pages, which belong
    // to the same mapping), and `map` has one byte per page.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, map.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    map.iter().filter(|&&b| b & 1 == 1).count() * page
}

#[test]
#[cfg(target_os = "linux")]
fn slabs_are_resident_only_where_written() {
    // 512 MiB of each element type: an untouched slab must not cost memory, or a worker's
    // idle resident size would be its whole KV budget.
    let n = 256 << 20;
    let f16s = slab::<f16>(n);
    let i8s = slab::<i8>(2 * n);
    let f32s = slab::<f32>(n / 2);
    for (name, bytes) in [
        ("f16", resident_bytes(&f16s)),
        ("i8", resident_bytes(&i8s)),
        ("f32", resident_bytes(&f32s)),
    ] {
        assert!(bytes < 8 << 20, "{name}: {} MiB resident", bytes >> 20);
    }
    assert!(f16s.iter().step_by(4099).all(|v| *v == f16::ZERO));
    let mut s = KvStore::new(2, 1 << 14, 16, 256, 256, KvDtype::F16);
    s.write(1, &[7], 3, &[1.0; 256], &[2.0; 256]);
    assert_eq!(s.read(1, &[7], 3), (vec![1.0; 256], vec![2.0; 256]));
    assert_eq!(s.read(1, &[7], 4), (vec![0.0; 256], vec![0.0; 256]));
}

#[test]
fn store_reads_back_what_was_written_through_the_table() {
    let mut s = KvStore::new(2, 4, 2, 3, 3, KvDtype::F32);
    let blocks = [3, 1];
    for pos in 0..4 {
        let k = [pos as f32; 3];
        let v = [-(pos as f32); 3];
        s.write(1, &blocks, pos, &k, &v);
    }
    for pos in 0..4 {
        let (k, v) = s.read(1, &blocks, pos);
        assert_eq!(k, [pos as f32; 3]);
        assert_eq!(v, [-(pos as f32); 3]);
    }
    let mut buf = [0f32; 3];
    let walked: Vec<f32> = s
        .slots(&blocks, 1..=3)
        .map(|o| {
            s.key(1, (1, o), 0, &mut buf);
            buf[0]
        })
        .collect();
    assert_eq!(walked, [1.0, 2.0, 3.0]);
    // Layer 0 untouched.
    assert_eq!(s.read(0, &blocks, 2).0, [0.0; 3]);
}

#[test]
fn compact_rows_round_trip_within_their_precision() {
    // Two KV heads of 4 with very different magnitudes: heads this short take one int8 scale
    // each.
    let k = [0.5, -1.25, 3.0, 0.001, 100.0, -50.0, 25.0, 0.0];
    let v = [-0.3, 0.2, 0.1, 0.0, 7.0, 7.5, -8.0, 1.0];
    for (dtype, tol) in [
        (KvDtype::F32, 0.0),
        (KvDtype::F16, 1e-3),
        (KvDtype::Int8, 0.5 / 127.0),
    ] {
        let mut s = KvStore::new(1, 2, 4, 8, 4, dtype);
        s.write(0, &[1], 2, &k, &v);
        let (rk, rv) = s.read(0, &[1], 2);
        for (got, want) in rk.iter().chain(&rv).zip(k.iter().chain(&v)) {
            // Relative to the head's largest value for int8, to the value itself for f16.
            let scale = if dtype == KvDtype::Int8 {
                100.0
            } else {
                want.abs().max(1.0)
            };
            assert!(
                (got - want).abs() <= tol * scale,
                "{dtype:?}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn int8_scales_cover_groups_of_32_keys_and_64_values_so_one_large_channel_does_not_coarsen_the_rest(
) {
    // One head of 128: a single large value in the first group, small ones everywhere else.
    let k: Vec<f32> = (0..128)
        .map(|i| {
            if i == 3 {
                40.0
            } else {
                ((i * 7) % 11) as f32 * 0.01 - 0.05
            }
        })
        .collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let mut s = KvStore::new(1, 1, 1, 128, 128, KvDtype::Int8);
    s.write(0, &[0], 0, &k, &v);
    let (rk, rv) = s.read(0, &[0], 0);
    for (row, want, group) in [(&rk, &k, 32), (&rv, &v, 64)] {
        for (i, (got, want)) in row.iter().zip(want.iter()).enumerate() {
            // Half a step of the group's own scale (and the f16 rounding of that scale).
            let group_max = if i < group { 40.0 } else { 0.05 };
            assert!(
                (got - want).abs() <= group_max / 127.0 * 0.501,
                "value {i} of a group of {group}: {got} vs {want}"
            );
        }
    }
    // 128 keys with four f16 scales, 128 values with two.
    assert_eq!(KvDtype::Int8.kv_row_bytes(128, 128), 136 + 132);
    assert_eq!(s.saved_bytes(1), 136 + 132);
    // Heads that 64 does not divide give values the keys' groups; heads that 32 does not
    // divide take one scale per head.
    assert_eq!(KvDtype::Int8.kv_row_bytes(96, 96), 2 * (96 + 3 * 2));
    assert_eq!(KvDtype::Int8.kv_row_bytes(8, 4), 2 * (8 + 2 * 2));
}

#[test]
fn balanced_int8_keys_read_back_unbalanced_with_finer_steps_where_the_factor_is_large() {
    // One head of 64, two layers; layer 1 balanced: channel 0 (and its RoPE partner 32) ×8.
    let mut a = vec![1f32; 64];
    (a[0], a[32]) = (8.0, 8.0);
    let k: Vec<f32> = (0..64)
        .map(|i| match i {
            0 => 0.1037,
            5 => 2.0,
            _ => 0.013 * i as f32 - 0.4,
        })
        .collect();
    let v = k.clone();
    let store = |dtype| {
        let mut s = KvStore::new(2, 1, 2, 64, 64, dtype)
            .with_key_balance(Some(vec![vec![1.0; 64], a.clone()]));
        for layer in 0..2 {
            s.write(layer, &[0], 0, &k, &v);
        }
        s
    };
    let s = store(KvDtype::Int8);
    let (plain, balanced) = (s.read(0, &[0], 0), s.read(1, &[0], 0));
    // Values are read back unbalanced, and the values are not balanced at all.
    assert_eq!(plain.1, balanced.1);
    let err = |r: &[f32], i: usize| (r[i] - k[i]).abs();
    for i in 0..64 {
        assert!(err(&balanced.0, i) <= 2.0 / 127.0 * 0.501, "channel {i}");
    }
    // Channel 0's step is an eighth of what the group's largest key (2.0) gives it unbalanced.
    assert!(err(&plain.0, 0) > 1e-3, "{}", err(&plain.0, 0));
    assert!(err(&balanced.0, 0) <= 2.0 / 127.0 / 8.0 * 0.501);
    // Other element types ignore the factors.
    let f16 = store(KvDtype::F16);
    assert_eq!(f16.read(1, &[0], 0), f16.read(0, &[0], 0));
}

#[test]
fn copy_save_and_load_move_blocks_exactly() {
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
        let mut s = KvStore::new(2, 3, 2, 4, 2, dtype);
        for layer in 0..2 {
            for pos in 0..2 {
                let k: Vec<f32> = (0..4)
                    .map(|i| (layer * 10 + pos * 4 + i) as f32 * 0.3)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                s.write(layer, &[0], pos, &k, &v);
            }
        }
        s.copy_block(0, 2, 1);
        assert_eq!(s.read(1, &[2], 0), s.read(1, &[0], 0));
        assert_eq!(
            s.read(1, &[2], 1).0,
            vec![0.0; 4],
            "only the first position copied"
        );
        let mut bytes = Vec::new();
        s.save_block(0, 2, &mut bytes);
        assert_eq!(bytes.len(), s.saved_bytes(2));
        s.load_block(1, 2, &bytes);
        for layer in 0..2 {
            for pos in 0..2 {
                assert_eq!(
                    s.read(layer, &[1], pos),
                    s.read(layer, &[0], pos),
                    "{dtype:?}"
                );
            }
        }
    }
}

#[test]
fn packed_blocks_read_back_the_global_layers_exactly() {
    use crate::kv::NO_BLOCK;
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
        // Four layers, 1 and 3 global: two blocks of two positions pack into one block.
        let packing = Packing::new(4, vec![1, 3]);
        assert_eq!(packing.as_ref().map(|p| p.per), Some(2));
        let mut s = KvStore::new(4, 5, 2, 4, 2, dtype).with_packing(packing);
        let table = [0, 1, 2];
        for layer in 0..4 {
            for pos in 0..6 {
                let k: Vec<f32> = (0..4)
                    .map(|i| ((layer * 31 + pos * 7 + i) % 13) as f32 - 6.0)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| x * 0.5 + 1.0).collect();
                s.write(layer, &table, pos, &k, &v);
            }
        }
        let rows = |s: &KvStore, layer, blocks: &[BlockId], packed: &[BlockId]| {
            let mut buf = [0f32; 2];
            s.rows(layer, blocks, packed, 0..=5)
                .map(|(at, slot)| {
                    let mut kv = Vec::new();
                    for g in 0..2 {
                        s.key(layer, (at, slot), g, &mut buf);
                        kv.extend_from_slice(&buf);
                        s.value(at, slot, g, &mut buf);
                        kv.extend_from_slice(&buf);
                    }
                    kv
                })
                .collect::<Vec<_>>()
        };
        let before = [rows(&s, 1, &table, &[]), rows(&s, 3, &table, &[])];
        s.pack(&table[..2], 4);
        // The source blocks are only read; the packed table reads the same rows.
        assert_eq!(rows(&s, 1, &table, &[]), before[0], "{dtype:?}");
        let packed_table = [NO_BLOCK, NO_BLOCK, 2];
        assert_eq!(rows(&s, 1, &packed_table, &[4]), before[0], "{dtype:?}");
        assert_eq!(rows(&s, 3, &packed_table, &[4]), before[1], "{dtype:?}");
    }
    assert!(Packing::new(4, vec![]).is_none(), "no global layer");
    assert!(Packing::new(3, vec![0, 1]).is_none(), "nothing to save");
}
