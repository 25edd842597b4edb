//! The bit storage of a filter: cache-line-aligned blocks whose pages the OS
//! maps only when first touched.
//!
//! The standard allocator zeroes an over-aligned allocation by writing it
//! (`posix_memalign` then `memset`), which made a 1 GiB filter take ~750 ms
//! and 1 GiB of resident memory before its first insert. `calloc` at the
//! platform's own alignment gets fresh zero pages from the OS instead, so
//! [`Blocks::zeroed`] asks for that and aligns the start itself: a 1 GiB
//! filter is then ready in microseconds and grows resident as inserts touch
//! it (`tests/filter/hostile_input.rs` checks the resident size).

use std::alloc::{Layout, dealloc};
use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;

use super::Block;

/// Blocks of a filter, owned either by a zeroed allocation of our own or as
/// a `Box` (decoded snapshots, and loom models, whose atomics zeroed bytes
/// do not make).
pub(super) struct Blocks {
    start: NonNull<Block>,
    len: usize,
    owner: Owner,
}

enum Owner {
    /// `calloc`-style memory: `base` as allocated, `start` rounded up inside it.
    #[cfg_attr(bloomguard_loom, allow(dead_code))]
    Zeroed { base: NonNull<u8>, layout: Layout },
    /// A `Box<[Block]>` taken apart with `Box::leak`: a `Box` moved
    /// after `start` was taken from it would claim its memory as unique
    /// again, and `start` would no longer be valid for reads (Stacked
    /// Borrows; Miri reports it).
    Boxed(NonNull<[Block]>),
}

// SAFETY: `Blocks` owns its memory like a `Box<[Block]>` does, and `Block`
// (atomics only) is `Send + Sync`; the raw pointers are never shared elsewhere.
unsafe impl Send for Blocks {}
// SAFETY: as above; `&Blocks` only hands out `&[Block]`.
unsafe impl Sync for Blocks {}

/// Whether `bytes` of blocks fit one allocation on this target (with the
/// aligning padding): `usize` alone admits sizes past `isize::MAX` on a
/// 32-bit target, which `Layout` refuses.
pub(super) fn fit_one_allocation(bytes: u64) -> bool {
    usize::try_from(bytes).is_ok_and(|bytes| bytes <= isize::MAX as usize - 64)
}

impl Blocks {
    /// `count` zeroed blocks, lazily mapped.
    #[cfg(not(bloomguard_loom))]
    pub(super) fn zeroed(count: usize) -> Self {
        use std::alloc::{alloc_zeroed, handle_alloc_error};
        const MIN_ALIGN: usize = 16;
        let padding = std::mem::align_of::<Block>() - MIN_ALIGN;
        let bytes = std::mem::size_of::<Block>()
            .checked_mul(count)
            .and_then(|b| b.checked_add(padding))
            .expect("the builder bounds a filter's size");
        if count == 0 {
            return Self::from(Vec::new());
        }
        let layout = Layout::from_size_align(bytes, MIN_ALIGN).expect("a valid layout");
        // SAFETY: `layout` has a non-zero size.
        let base = unsafe { alloc_zeroed(layout) };
        let Some(base) = NonNull::new(base) else {
            handle_alloc_error(layout)
        };
        let offset = base.as_ptr().align_offset(std::mem::align_of::<Block>());
        debug_assert!(offset <= padding);
        // SAFETY: `offset ≤ padding`, so `start .. start + count` blocks lies
        // inside the allocation; the memory is zeroed, and all-zero bytes are
        // a valid `Block` (atomics holding 0).
        let start = unsafe { NonNull::new_unchecked(base.as_ptr().add(offset).cast::<Block>()) };
        Self {
            start,
            len: count,
            owner: Owner::Zeroed { base, layout },
        }
    }

    /// `count` zeroed blocks (loom's atomics are built, not zeroed).
    #[cfg(bloomguard_loom)]
    pub(super) fn zeroed(count: usize) -> Self {
        (0..count)
            .map(|_| Block(std::array::from_fn(|_| crate::sync::AtomicU64::new(0))))
            .collect::<Vec<_>>()
            .into()
    }
}

impl From<Vec<Block>> for Blocks {
    fn from(blocks: Vec<Block>) -> Self {
        let boxed = NonNull::from(Box::leak(blocks.into_boxed_slice()));
        Self {
            start: boxed.cast::<Block>(),
            len: boxed.len(),
            owner: Owner::Boxed(boxed),
        }
    }
}

impl Deref for Blocks {
    type Target = [Block];

    #[inline]
    fn deref(&self) -> &[Block] {
        // SAFETY: `start` points to `len` initialised blocks that `owner`
        // keeps alive for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.len) }
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        match self.owner {
            // SAFETY: allocated in `zeroed` with this very layout, and freed
            // only here. `Block` has no drop glue to run first.
            Owner::Zeroed { base, layout } => unsafe { dealloc(base.as_ptr(), layout) },
            // SAFETY: leaked from a `Box` in `from`, and given back only here.
            Owner::Boxed(boxed) => drop(unsafe { Box::from_raw(boxed.as_ptr()) }),
        }
    }
}

impl fmt::Debug for Blocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blocks").field("len", &self.len).finish()
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use crate::sync::Ordering;

    /// Decoded filters own their blocks as a `Box` (`From<Vec>`), read
    /// through the pointer taken from it. Run under Miri
    /// (`cargo +nightly miri test --no-default-features --lib filter::blocks`)
    /// to check that the pointer stays valid when the `Blocks` moves.
    #[test]
    fn blocks_made_from_a_vec_are_read_and_written_through_their_start() {
        let blocks: Blocks = (0..4)
            .map(|_| Block(std::array::from_fn(|_| crate::sync::AtomicU64::new(0))))
            .collect::<Vec<_>>()
            .into();
        blocks[3].0[7].fetch_or(1 << 9, Ordering::Relaxed);
        let moved = blocks;
        assert_eq!(moved[3].0[7].load(Ordering::Relaxed), 1 << 9);
        assert_eq!(moved.len(), 4);
    }
}
