//! The baseline a weight pager is measured against: what an LRU page cache of the same
//! capacity would read on the same sequence of accesses (a model `mmap`ed under the same
//! memory limit, the kernel evicting its least recently used pages). Simulated, not run: the
//! sequence is the one a pager recorded ([`crate::weights::WeightPager::record_accesses`]),
//! so both sides see exactly the same reads in the same order.
//!
//! A reader that sweeps more bytes than the cache holds, in the same order every pass, is the
//! case LRU handles worst: every page is evicted just before it is needed again, and each pass
//! reads everything. A fixed resident set (what the pager keeps hot) reads only the rest.

use std::collections::{BTreeMap, HashMap};

/// An LRU cache of `capacity` pages, counting hits and misses.
#[derive(Debug, Clone)]
pub struct LruSim {
    capacity: usize,
    clock: u64,
    /// Page -> time of its last access.
    last: HashMap<usize, u64>,
    /// Time of last access -> page, oldest first.
    order: BTreeMap<u64, usize>,
    pub hits: u64,
    pub misses: u64,
}

impl LruSim {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, clock: 0, last: HashMap::new(), order: BTreeMap::new(), hits: 0, misses: 0 }
    }

    /// One access to `page`; true on a hit. A miss brings the page in, evicting the least
    /// recently used one when the cache is full (a cache of capacity 0 misses everything).
    pub fn access(&mut self, page: usize) -> bool {
        self.clock += 1;
        if let Some(t) = self.last.insert(page, self.clock) {
            self.order.remove(&t);
            self.order.insert(self.clock, page);
            self.hits += 1;
            return true;
        }
        self.misses += 1;
        if self.capacity == 0 {
            self.last.remove(&page);
            return false;
        }
        self.order.insert(self.clock, page);
        if self.last.len() > self.capacity {
            if let Some((_, old)) = self.order.pop_first() {
                self.last.remove(&old);
            }
        }
        false
    }

    /// Every page of each range in turn; returns the misses.
    pub fn access_ranges(&mut self, ranges: &[std::ops::Range<usize>]) -> u64 {
        let before = self.misses;
        for r in ranges {
            for p in r.clone() {
                self.access(p);
            }
        }
        self.misses - before
    }

    /// Pages held now.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: a plain list, most recent last.
    fn naive(capacity: usize, seq: &[usize]) -> u64 {
        let mut held: Vec<usize> = Vec::new();
        let mut misses = 0;
        for &p in seq {
            if let Some(i) = held.iter().position(|&x| x == p) {
                held.remove(i);
            } else {
                misses += 1;
                if held.len() == capacity {
                    if capacity == 0 {
                        continue;
                    }
                    held.remove(0);
                }
            }
            held.push(p);
        }
        misses
    }

    #[test]
    fn matches_a_plain_list_on_random_sequences() {
        let mut x = 0x9e37_79b9_u64;
        for capacity in [0, 1, 2, 5, 17] {
            let seq: Vec<usize> = (0..2000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 40) as usize
                })
                .collect();
            let mut sim = LruSim::new(capacity);
            seq.iter().for_each(|&p| {
                sim.access(p);
            });
            assert_eq!(sim.misses, naive(capacity, &seq), "capacity {capacity}");
            assert_eq!(sim.hits + sim.misses, seq.len() as u64);
            assert!(sim.len() <= capacity);
        }
    }

    #[test]
    fn a_cyclic_sweep_larger_than_the_cache_misses_every_page() {
        let mut sim = LruSim::new(50);
        let pass = [0..60, 60..100];
        assert_eq!(sim.access_ranges(&pass), 100);
        assert_eq!(sim.access_ranges(&pass), 100, "LRU evicts each page just before its reuse");
        let mut fits = LruSim::new(100);
        fits.access_ranges(&pass);
        assert_eq!(fits.access_ranges(&pass), 0);
    }
}
