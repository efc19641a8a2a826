//! The free-block queue: an intrusive doubly linked list over block ids.
//!
//! vLLM's `FreeKVCacheBlockQueue`: the links live in two flat arrays indexed
//! by block id, so pushing, popping and removing a block from the middle (a
//! cache hit reviving a free block) are O(1) and never allocate. The head is
//! the next block to hand out (and to evict, if it still holds a cached hash).

use super::BlockId;

/// A doubly linked list of free block ids with a sentinel at index `n`.
#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue over blocks `0..num_blocks` holding all of them in id order.
    pub fn new_full(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let sentinel = num_blocks;
        // Circular list: sentinel -> 0 -> 1 -> ... -> n-1 -> sentinel.
        let next: Vec<u32> = (1..=num_blocks).chain([0]).collect();
        let prev: Vec<u32> = std::iter::once(sentinel).chain(0..num_blocks).collect();
        Self { prev, next, len: n }
    }

    fn sentinel(&self) -> u32 {
        (self.next.len() - 1) as u32
    }

    /// Number of blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is free.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block at the head (the next to be handed out), if any.
    pub fn front(&self) -> Option<BlockId> {
        let s = self.sentinel();
        let h = self.next[s as usize];
        (h != s).then_some(h)
    }

    /// Removes and returns the head block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let h = self.front()?;
        self.remove(h);
        Some(h)
    }

    /// Unlinks `block`, which must be in the queue (the caller tracks
    /// membership: a block is queued exactly when its reference count is 0).
    pub fn remove(&mut self, block: BlockId) {
        let b = block as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.len -= 1;
    }

    /// Appends `block` at the tail: it will be handed out after every block
    /// already queued.
    pub fn push_back(&mut self, block: BlockId) {
        let s = self.sentinel();
        let tail = self.prev[s as usize];
        self.link(tail, block, s);
    }

    /// Prepends `block` at the head: it will be handed out next.
    pub fn push_front(&mut self, block: BlockId) {
        let s = self.sentinel();
        let head = self.next[s as usize];
        self.link(s, block, head);
    }

    fn link(&mut self, p: u32, b: BlockId, n: u32) {
        self.next[p as usize] = b;
        self.prev[b as usize] = p;
        self.next[b as usize] = n;
        self.prev[n as usize] = b;
        self.len += 1;
    }

    /// The queued blocks from head to tail (for tests and invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let s = self.sentinel();
        let mut cur = self.next[s as usize];
        std::iter::from_fn(move || {
            if cur == s {
                None
            } else {
                let b = cur;
                cur = self.next[b as usize];
                Some(b)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_full_in_id_order_and_supports_middle_removal() {
        let mut q = FreeBlockQueue::new_full(5);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        q.remove(2);
        q.remove(0);
        q.remove(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(q.len(), 2);
        q.push_back(4);
        q.push_front(0);
        q.push_back(2);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 3, 4, 2]);
        assert_eq!(q.pop_front(), Some(0));
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!(q.len(), 3);
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.front(), None);
        q.push_back(3);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![3]);
    }
}
