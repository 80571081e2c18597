//! The LCTRU queue (LLMS §3.4): Least Compression-Tolerable and Recently Used.
//!
//! Resident chunks sit in one sub-queue per compression level, each ordered by last use.
//! Reclaim takes from the least compressed (heaviest) level first, least recently used first
//! within it, and never a pinned chunk: evicting heavy chunks frees the most memory per chunk
//! and, by eq. 4, leaves fewer chunks to reload later.

use std::collections::BTreeMap;

use crate::IdMap;

/// A chunk: (context, chunk index).
pub type ChunkId = (u64, u32);

#[derive(Debug, Default)]
pub struct Lctru {
    /// Per level (0 = least compressed), last-use tick -> chunk.
    levels: Vec<BTreeMap<u64, ChunkId>>,
    at: IdMap<ChunkId, (usize, u64)>,
    tick: u64,
}

impl Lctru {
    pub fn new(n_levels: usize) -> Self {
        Self { levels: (0..n_levels.max(1)).map(|_| BTreeMap::new()).collect(), at: IdMap::default(), tick: 0 }
    }

    pub fn len(&self) -> usize {
        self.at.len()
    }
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }
    pub fn contains(&self, c: ChunkId) -> bool {
        self.at.contains_key(&c)
    }

    /// Inserts or refreshes a chunk at `level` as the most recently used.
    pub fn touch(&mut self, c: ChunkId, level: usize) {
        let level = level.min(self.levels.len() - 1);
        self.remove(c);
        self.tick += 1;
        self.levels[level].insert(self.tick, c);
        self.at.insert(c, (level, self.tick));
    }

    /// Moves a chunk to another level keeping its recency.
    pub fn set_level(&mut self, c: ChunkId, level: usize) {
        let level = level.min(self.levels.len() - 1);
        if let Some((l, t)) = self.at.get(&c).copied() {
            self.levels[l].remove(&t);
            self.levels[level].insert(t, c);
            self.at.insert(c, (level, t));
        }
    }

    /// Gives chunk `from`'s place (its level and recency) to `to`, which was not queued: a
    /// chunk that changes its name and nothing else (a context's own chunk promoted into the
    /// pool by a fork, which reads nothing). Returns false, changing nothing, when `from` was
    /// not queued.
    pub fn rename(&mut self, from: ChunkId, to: ChunkId) -> bool {
        let Some((l, t)) = self.at.remove(&from) else { return false };
        self.remove(to);
        if let Some(c) = self.levels[l].get_mut(&t) {
            *c = to;
        }
        self.at.insert(to, (l, t));
        true
    }

    pub fn remove(&mut self, c: ChunkId) -> bool {
        match self.at.remove(&c) {
            Some((l, t)) => {
                self.levels[l].remove(&t);
                true
            }
            None => false,
        }
    }

    /// The next chunk to reclaim (removed from the queue), skipping pinned ones.
    pub fn pop_victim(&mut self, pinned: &dyn Fn(ChunkId) -> bool) -> Option<ChunkId> {
        let victim = self.levels.iter().find_map(|q| q.values().copied().find(|&c| !pinned(c)))?;
        self.remove(victim);
        Some(victim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heaviest_level_first_then_least_recent_and_never_pinned() {
        let mut q = Lctru::new(3);
        q.touch((1, 0), 0);
        q.touch((1, 1), 1);
        q.touch((2, 0), 0);
        q.touch((2, 1), 2);
        q.touch((1, 0), 0); // used again: now the most recent at level 0
        let pinned = |c: ChunkId| c == (2, 0);
        assert_eq!(q.pop_victim(&pinned), Some((1, 0)), "level 0 first; (2,0) is pinned");
        assert_eq!(q.pop_victim(&pinned), Some((1, 1)), "then level 1");
        q.set_level((2, 0), 2);
        // set_level keeps recency: (2,0) was last used before (2,1).
        assert_eq!(q.pop_victim(&pinned), Some((2, 1)), "(2,0) is still pinned");
        assert_eq!(q.pop_victim(&pinned), None, "only a pinned chunk is left");
        assert_eq!(q.pop_victim(&|_| false), Some((2, 0)));
        assert!(q.is_empty());
    }

    /// A renamed chunk keeps its level and its place in the order; the old name is gone.
    #[test]
    fn a_renamed_chunk_keeps_its_place() {
        let mut q = Lctru::new(2);
        q.touch((1, 0), 0);
        q.touch((1, 1), 0);
        q.touch((1, 2), 1);
        assert!(q.rename((1, 0), (9, 0)));
        assert!(!q.rename((1, 0), (9, 1)), "no longer queued");
        assert!(!q.contains((1, 0)) && q.contains((9, 0)) && !q.contains((9, 1)));
        assert_eq!(q.len(), 3);
        let none = |_: ChunkId| false;
        assert_eq!(q.pop_victim(&none), Some((9, 0)), "the least recent at level 0, as (1,0) was");
        assert_eq!(q.pop_victim(&none), Some((1, 1)));
        assert_eq!(q.pop_victim(&none), Some((1, 2)));
        assert!(q.is_empty());
    }
}
