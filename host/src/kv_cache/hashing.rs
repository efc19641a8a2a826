//! Chained block hashes for prefix caching.
//!
//! A full block's hash covers its parent's hash, the block's token ids and,
//! for the first block only, an optional extra key (a cache salt or adapter
//! id); chaining makes the hash of block `k` depend on every token before it,
//! so equal hashes mean equal prefixes, as in vLLM's `hash_block_tokens`.
//!
//! # Choice of hash and collision risk
//!
//! The function is SipHash-1-3 (the algorithm behind Rust's `HashMap`),
//! written here over 64-bit words so a 16-token block costs about ten
//! compression rounds (tens of nanoseconds) and so its output does not change
//! with the Rust release. It is only computed when a block fills, never per
//! decoded token.
//!
//! The output is 64 bits and a hit is trusted without comparing tokens, so a
//! collision would make a request reuse another prefix's KV (wrong output,
//! never memory unsafety). With `N` cached blocks the chance that one lookup
//! collides by accident is about `N / 2^64` (1e-13 for a million blocks).
//!
//! The default key is random per process (vLLM likewise seeds its
//! `NONE_HASH` from `os.urandom` unless `PYTHONHASHSEED` is set), so a client
//! cannot compute block hashes offline: poisoning another tenant's prefix or
//! flooding one hash-map bucket would need the key. Hashes never leave the
//! engine process today; a future component that shares them across
//! processes (a KV connector) passes one fixed key to
//! [`BlockHasher::with_key`] everywhere. vLLM defaults to SHA-256; we trade
//! its 256-bit margin for a keyed hash that is ~20x cheaper.

/// The hash of one full block of tokens, chained over all blocks before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Computes chained block hashes with a 128-bit SipHash key.
#[derive(Debug, Clone, Copy)]
pub struct BlockHasher {
    key: [u64; 2],
    /// The parent hash of a request's first block (vLLM's `NONE_HASH`),
    /// derived from the key so that different keys never share chains.
    none_hash: BlockHash,
}

impl Default for BlockHasher {
    /// A hasher with a random per-process key.
    fn default() -> Self {
        Self::with_key([random_u64(1), random_u64(2)])
    }
}

/// 64 random bits from the OS-seeded keys of std's `RandomState`.
fn random_u64(salt: u64) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(salt)
}

/// Hashes [`BlockHash`] keys for the cached-block map. Block hashes are
/// already uniform, so one folded multiply with a random per-map seed is
/// enough to spread them (and keeps a client who knows a fixed block-hash
/// key from aiming many entries at one bucket); std's SipHash would cost
/// ~20x more per lookup.
#[derive(Debug, Clone, Copy)]
pub struct BlockHashState {
    seed: u64,
}

impl Default for BlockHashState {
    fn default() -> Self {
        Self {
            seed: random_u64(3),
        }
    }
}

impl std::hash::BuildHasher for BlockHashState {
    type Hasher = BlockHashMapHasher;
    fn build_hasher(&self) -> BlockHashMapHasher {
        BlockHashMapHasher {
            seed: self.seed,
            value: 0,
        }
    }
}

/// The hasher [`BlockHashState`] builds; it expects one `write_u64`.
#[derive(Debug, Clone, Copy)]
pub struct BlockHashMapHasher {
    seed: u64,
    value: u64,
}

impl std::hash::Hasher for BlockHashMapHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        // Folded 64x64->128 multiply (as in foldhash): every input bit
        // reaches the low bits hashbrown indexes with.
        let p = u128::from(x ^ self.seed ^ self.value) * 0x9e37_79b9_7f4a_7c15_u128;
        self.value = (p as u64) ^ ((p >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        self.value
    }
}

/// The extra key of a request's cache salt (vLLM's `cache_salt`): requests
/// with different salts never share prefix-cache blocks, so a tenant cannot
/// learn from a hit's speed what another sent. The same salt gives the same
/// key in every process (the block hash then keys it with the process's
/// own key), so a data-parallel router hashing a prompt agrees with the
/// engines.
pub fn cache_salt_key(salt: &str) -> u64 {
    let mut sip = SipHasher13::new([0, 0]);
    sip.write(b"kv-cache-salt\0");
    sip.write(salt.as_bytes());
    sip.finish()
}

impl BlockHasher {
    /// A hasher with the given 128-bit key.
    pub fn with_key(key: [u64; 2]) -> Self {
        let mut sip = SipHasher13::new(key);
        sip.write(b"kv-block-none-hash");
        let none_hash = BlockHash(sip.finish());
        Self { key, none_hash }
    }

    /// The parent hash used for a request's first block.
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// Hashes one full block: `parent` is the previous block's hash (or `None`
    /// for the first block), `tokens` the block's token ids and `extra_key` a
    /// value that must also match for a hit (only pass it for the first block:
    /// the chain carries it to every later one).
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        tokens: &[u32],
        extra_key: Option<u64>,
    ) -> BlockHash {
        let mut sip = SipHasher13::new(self.key);
        sip.write_u64(parent.unwrap_or(self.none_hash).0);
        // A marker word keeps "no extra key" distinct from every key value.
        match extra_key {
            None => sip.write_u64(0),
            Some(key) => {
                sip.write_u64(1);
                sip.write_u64(key);
            }
        }
        for &t in tokens {
            sip.write_u32(t);
        }
        BlockHash(sip.finish())
    }
}

/// Streaming SipHash-c-d over little-endian bytes, with fast paths for the
/// aligned 32- and 64-bit writes the block hash uses.
#[derive(Debug, Clone)]
struct SipHasher<const C: usize, const D: usize> {
    v: [u64; 4],
    /// Bytes written so far (only the low 8 bits enter the final block).
    len: u64,
    /// Pending bytes not yet forming a full word, little-endian.
    tail: u64,
    ntail: u32,
}

/// SipHash-1-3: one compression and three finalization rounds.
type SipHasher13 = SipHasher<1, 3>;

impl<const C: usize, const D: usize> SipHasher<C, D> {
    fn new(key: [u64; 2]) -> Self {
        Self {
            v: [
                key[0] ^ 0x736f_6d65_7073_6575,
                key[1] ^ 0x646f_7261_6e64_6f6d,
                key[0] ^ 0x6c79_6765_6e65_7261,
                key[1] ^ 0x7465_6462_7974_6573,
            ],
            len: 0,
            tail: 0,
            ntail: 0,
        }
    }

    #[inline(always)]
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }

    #[inline(always)]
    fn compress(&mut self, m: u64) {
        self.v[3] ^= m;
        for _ in 0..C {
            Self::round(&mut self.v);
        }
        self.v[0] ^= m;
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        if self.ntail == 0 {
            self.len += 8;
            self.compress(x);
        } else {
            self.write(&x.to_le_bytes());
        }
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        match self.ntail {
            0 => {
                self.tail = u64::from(x);
                self.ntail = 4;
                self.len += 4;
            }
            4 => {
                let m = self.tail | (u64::from(x) << 32);
                self.tail = 0;
                self.ntail = 0;
                self.len += 4;
                self.compress(m);
            }
            _ => self.write(&x.to_le_bytes()),
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.tail |= u64::from(b) << (8 * self.ntail);
            self.ntail += 1;
            self.len += 1;
            if self.ntail == 8 {
                let m = self.tail;
                self.tail = 0;
                self.ntail = 0;
                self.compress(m);
            }
        }
    }

    fn finish(mut self) -> u64 {
        let b = ((self.len & 0xff) << 56) | self.tail;
        self.compress(b);
        self.v[2] ^= 0xff;
        for _ in 0..D {
            Self::round(&mut self.v);
        }
        self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    /// The SipHash paper's test vector (Aumasson & Bernstein, appendix A):
    /// SipHash-2-4, key 00..0f, message 00..0e.
    #[test]
    fn siphash24_matches_the_paper_vector() {
        let key = [0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908];
        let msg: Vec<u8> = (0u8..15).collect();
        let mut h = SipHasher::<2, 4>::new(key);
        h.write(&msg);
        assert_eq!(h.finish(), 0xa129_ca61_49be_45e5);
    }

    /// std's `DefaultHasher::new()` is SipHash-1-3 with a zero key; feeding it
    /// the same bytes through `Hasher::write` (which adds no framing) gives an
    /// independent reference for the word-level fast paths.
    #[test]
    fn siphash13_word_writes_match_std_byte_stream() {
        let mut ours = SipHasher13::new([0, 0]);
        let mut bytes = Vec::new();
        for (i, t) in [7u32, 49151, 0, 12345, 99].iter().enumerate() {
            if i == 2 {
                ours.write_u64(0xdead_beef_0123_4567);
                bytes.extend_from_slice(&0xdead_beef_0123_4567u64.to_le_bytes());
            }
            ours.write_u32(*t);
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut std_hasher = std::collections::hash_map::DefaultHasher::new();
        std_hasher.write(&bytes);
        assert_eq!(ours.finish(), std_hasher.finish());
    }

    #[test]
    fn chained_hash_depends_on_parent_tokens_and_extra_key() {
        let h = BlockHasher::default();
        let a = h.hash_block(None, &[1, 2, 3, 4], None);
        assert_eq!(a, h.hash_block(None, &[1, 2, 3, 4], None));
        assert_ne!(a, h.hash_block(None, &[1, 2, 3, 5], None));
        assert_ne!(a, h.hash_block(None, &[1, 2, 3, 4], Some(0)));
        assert_ne!(
            h.hash_block(None, &[1, 2, 3, 4], Some(1)),
            h.hash_block(None, &[1, 2, 3, 4], Some(2))
        );
        // Same tokens under different parents give different hashes.
        let b1 = h.hash_block(Some(a), &[5, 6, 7, 8], None);
        let other = h.hash_block(None, &[9, 9, 9, 9], None);
        assert_ne!(b1, h.hash_block(Some(other), &[5, 6, 7, 8], None));
        // None parent is exactly the none hash.
        assert_eq!(a, h.hash_block(Some(h.none_hash()), &[1, 2, 3, 4], None));
        // A different key gives a different chain.
        let k = BlockHasher::with_key([1, 2]);
        assert_ne!(a, k.hash_block(None, &[1, 2, 3, 4], None));
    }
}
