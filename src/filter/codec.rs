//! The snapshot format: a versioned, checksummed, little-endian encoding of a filter.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "BLMGUARD"
//!      8     2  format version (1)
//!     10     1  layout id (1: 512-bit blocks of eight u64 words)
//!     11     1  hash scheme id (1: see below)
//!     12     4  k
//!     16     8  blocks
//!     24     8  seed
//!     32     8  capacity (expected items; 0 when sized by explicit parameters)
//!     40     8  target FPR as IEEE-754 bits (0 when sized by explicit parameters)
//!     48     8  reserved, 0
//!     56  64·b  payload: the words, block by block, each little-endian
//!   end-16   8  set bits in the payload (the exact counter, checked on load)
//!    end-8   8  xxh3-64 of every byte before it
//! ```
//!
//! Hash scheme 1: a key's hash is xxh3-64 of its bytes with the seed; its
//! block is the high half of `hash × blocks` (multiply-high); its k probe
//! bits are consecutive 9-bit slices, lowest first, of the SplitMix64
//! finalizer of the hash, the word mixed again (after adding
//! `0x9e3779b97f4a7c15`) every seven probes; probe bit `b` is bit `b % 64`
//! of the block's word `b / 64`.
//!
//! Version 1 is a promise: golden files under `tests/golden/` pin it, and every
//! later build must read them back with identical answers.

use std::io::{Read, Write};

use super::hash::HASH_SCHEME_ID;
use super::math::{BLOCK_BITS, MAX_HASHES};
use super::{AtomicBloom, Block, DEFAULT_MAX_BYTES};
use crate::error::DecodeError;
use crate::sync::{AtomicU64, Ordering};
use xxhash_rust::xxh3::Xxh3Default;

const MAGIC: [u8; 8] = *b"BLMGUARD";
/// The newest snapshot format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
const LAYOUT_BLOCKED_512: u8 = 1;
const HEADER_LEN: usize = 56;
const TRAILER_LEN: usize = 16;
const BLOCK_BYTES: u64 = BLOCK_BITS / 8;
/// Blocks encoded per buffer fill: 64 KiB.
const CHUNK_BLOCKS: usize = 1024;

impl AtomicBloom {
    /// The snapshot's length in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.blocks.len() * BLOCK_BYTES as usize + TRAILER_LEN
    }

    /// Encodes the filter into a new buffer (see [`write_to`](Self::write_to)).
    ///
    /// ```
    /// use bloomguard::AtomicBloom;
    ///
    /// let filter = AtomicBloom::new(1000, 0.01)?;
    /// filter.insert("k");
    /// let copy = AtomicBloom::from_bytes(&filter.to_bytes())?;
    /// assert!(copy.contains("k"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.encoded_len());
        self.write_to(&mut bytes)
            .expect("writing into a Vec does not fail");
        bytes
    }

    /// Writes the snapshot to `writer`, streaming the payload in 64 KiB pieces.
    ///
    /// Concurrent inserts may go on: each word is read once, so the snapshot
    /// holds every key whose insert finished before the call began, and its
    /// set-bit count matches its payload exactly.
    ///
    /// ```
    /// use bloomguard::AtomicBloom;
    ///
    /// let filter = AtomicBloom::new(1_000, 0.01)?;
    /// filter.insert("k");
    /// let mut file = Vec::new(); // any `io::Write`: a file, a socket
    /// filter.write_to(&mut file)?;
    /// let restored = AtomicBloom::read_from(&file[..])?;
    /// assert!(restored.contains("k"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// Whatever `writer` returns.
    pub fn write_to(&self, mut writer: impl Write) -> std::io::Result<()> {
        let mut checksum = Xxh3Default::new();
        let mut emit = |bytes: &[u8]| {
            checksum.update(bytes);
            writer.write_all(bytes)
        };
        emit(&self.header())?;
        let mut set_bits = 0u64;
        let mut buffer = Vec::with_capacity(CHUNK_BLOCKS * BLOCK_BYTES as usize);
        for chunk in self.blocks.chunks(CHUNK_BLOCKS) {
            buffer.clear();
            for word in chunk.iter().flat_map(|block| &block.0) {
                let value = word.load(Ordering::Relaxed);
                set_bits += u64::from(value.count_ones());
                buffer.extend_from_slice(&value.to_le_bytes());
            }
            emit(&buffer)?;
        }
        emit(&set_bits.to_le_bytes())?;
        writer.write_all(&checksum.digest().to_le_bytes())
    }

    /// Decodes a snapshot made by [`to_bytes`](Self::to_bytes) or
    /// [`write_to`](Self::write_to), which must span all of `bytes`.
    ///
    /// # Errors
    /// [`DecodeError`] for anything but an intact snapshot of a version this
    /// build reads: wrong magic, future version, unknown layout or hash,
    /// impossible parameters, truncation, trailing bytes, a checksum or
    /// set-bit count that does not match.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let header = bytes
            .first_chunk::<HEADER_LEN>()
            .ok_or(DecodeError::Truncated)?;
        let payload = parse_header(header)?.blocks.saturating_mul(BLOCK_BYTES);
        // Compare lengths before allocating: a forged block count must not make
        // us reserve more than the input could ever fill.
        let expected = payload.saturating_add((HEADER_LEN + TRAILER_LEN) as u64);
        match (bytes.len() as u64).cmp(&expected) {
            std::cmp::Ordering::Less => Err(DecodeError::Truncated),
            std::cmp::Ordering::Greater => Err(DecodeError::TrailingBytes),
            std::cmp::Ordering::Equal => decode(&mut &bytes[..], payload, Claim::Checked),
        }
    }

    /// Decodes one snapshot from `reader`, reading no further than its end,
    /// and refusing filters over [`DEFAULT_MAX_BYTES`].
    ///
    /// Memory grows with the bytes that actually arrive (at most twice
    /// them), not with the size the header claims: a stream that lies about
    /// its size costs what it sent.
    ///
    /// # Errors
    /// As [`from_bytes`](Self::from_bytes), bar trailing bytes, plus I/O errors.
    pub fn read_from(reader: impl Read) -> Result<Self, DecodeError> {
        Self::read_from_with_max_bytes(reader, DEFAULT_MAX_BYTES)
    }

    /// [`read_from`](Self::read_from) with a memory budget of `max_bytes`.
    ///
    /// # Errors
    /// As [`read_from`](Self::read_from).
    pub fn read_from_with_max_bytes(
        mut reader: impl Read,
        max_bytes: u64,
    ) -> Result<Self, DecodeError> {
        decode(&mut reader, max_bytes, Claim::Unverified)
    }

    fn header(&self) -> [u8; HEADER_LEN] {
        let (capacity, target_fpr) = self.target.map_or((0, 0.0), |(items, fpr)| (items, fpr));
        let mut header = [0u8; HEADER_LEN];
        header[0..8].copy_from_slice(&MAGIC);
        header[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[10] = LAYOUT_BLOCKED_512;
        header[11] = HASH_SCHEME_ID;
        header[12..16].copy_from_slice(&self.k.to_le_bytes());
        header[16..24].copy_from_slice(&(self.blocks.len() as u64).to_le_bytes());
        header[24..32].copy_from_slice(&self.seed.to_le_bytes());
        header[32..40].copy_from_slice(&capacity.to_le_bytes());
        header[40..48].copy_from_slice(&target_fpr.to_bits().to_le_bytes());
        header
    }
}

struct Header {
    k: u32,
    blocks: u64,
    seed: u64,
    target: Option<(u64, f64)>,
}

/// How much of a snapshot's claimed size the decoder may reserve before the
/// payload has arrived.
#[derive(Clone, Copy)]
enum Claim {
    /// The input's length was checked against the header: reserve it all.
    Checked,
    /// A stream of unknown length: grow with what actually arrives, so a
    /// header that lies about the size costs nothing.
    Unverified,
}

/// Blocks read from the input per step: 4 KiB, on the stack.
const STEP_BLOCKS: usize = 64;

fn decode(
    reader: &mut impl Read,
    max_bytes: u64,
    claim: Claim,
) -> Result<AtomicBloom, DecodeError> {
    let mut checksum = Xxh3Default::new();
    let mut header = [0u8; HEADER_LEN];
    reader.read_exact(&mut header)?;
    checksum.update(&header);
    let header = parse_header(&header)?;
    let bytes = header.blocks.saturating_mul(BLOCK_BYTES);
    if bytes > max_bytes || !super::blocks::fit_one_allocation(bytes) {
        return Err(DecodeError::TooLarge { bytes, max_bytes });
    }

    let claimed = header.blocks as usize;
    let mut blocks: Vec<Block> = match claim {
        Claim::Checked => Vec::with_capacity(claimed),
        Claim::Unverified => Vec::new(),
    };
    let mut set_bits = 0u64;
    let mut step = [0u8; STEP_BLOCKS * BLOCK_BYTES as usize];
    while blocks.len() < claimed {
        let count = (claimed - blocks.len()).min(STEP_BLOCKS);
        let step = &mut step[..count * BLOCK_BYTES as usize];
        reader.read_exact(step)?;
        checksum.update(step);
        if blocks.capacity() - blocks.len() < count {
            // At most double what has arrived: memory follows the bytes read.
            let grow = count.max(blocks.len()).min(claimed - blocks.len());
            blocks.reserve_exact(grow);
        }
        for bytes in step.chunks_exact(BLOCK_BYTES as usize) {
            let words = std::array::from_fn(|i| {
                let value = read_u64(bytes, i * 8);
                set_bits += u64::from(value.count_ones());
                AtomicU64::new(value)
            });
            blocks.push(Block(words));
        }
    }
    let filter = AtomicBloom::from_blocks(blocks.into(), header.k, header.seed, header.target);

    let mut trailer = [0u8; TRAILER_LEN];
    reader.read_exact(&mut trailer)?;
    checksum.update(&trailer[..8]);
    if checksum.digest() != read_u64(&trailer, 8) {
        return Err(DecodeError::ChecksumMismatch);
    }
    if read_u64(&trailer, 0) != set_bits {
        return Err(DecodeError::InvalidHeader(
            "set-bit count does not match the payload",
        ));
    }
    filter.set_bits.set(set_bits);
    Ok(filter)
}

fn parse_header(header: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
    if header[0..8] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let version = u16::from_le_bytes([header[8], header[9]]);
    if version > FORMAT_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version == 0 {
        return Err(DecodeError::InvalidHeader(
            "format version 0 does not exist",
        ));
    }
    if header[10] != LAYOUT_BLOCKED_512 {
        return Err(DecodeError::UnknownScheme {
            what: "layout",
            id: header[10],
        });
    }
    if header[11] != HASH_SCHEME_ID {
        return Err(DecodeError::UnknownScheme {
            what: "hash",
            id: header[11],
        });
    }
    let k = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes"));
    if !(1..=MAX_HASHES).contains(&k) {
        return Err(DecodeError::InvalidHeader("k is outside 1..=32"));
    }
    let blocks = read_u64(header, 16);
    if blocks == 0 {
        return Err(DecodeError::InvalidHeader(
            "a filter has at least one block",
        ));
    }
    let seed = read_u64(header, 24);
    let capacity = read_u64(header, 32);
    let target_fpr = f64::from_bits(read_u64(header, 40));
    let target = match (capacity, target_fpr) {
        (0, fpr) if fpr.to_bits() == 0 => None,
        (items, fpr) if items > 0 && fpr > 0.0 && fpr < 1.0 => Some((items, fpr)),
        _ => {
            return Err(DecodeError::InvalidHeader(
                "capacity and target FPR disagree",
            ));
        }
    };
    if read_u64(header, 48) != 0 {
        return Err(DecodeError::InvalidHeader("reserved field is not zero"));
    }
    Ok(Header {
        k,
        blocks,
        seed,
        target,
    })
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}
