//! Bookkeeping for the data plane's shared tables: ids for services and
//! backends, and regions of the Maglev pool.

use std::collections::VecDeque;

/// Ids `0..max`, reused oldest-freed first so that a freed id (whose
/// counters and flows may still be read) is reused as late as possible.
#[derive(Debug)]
pub struct IdPool {
    next: u32,
    max: u32,
    free: VecDeque<u32>,
}

impl IdPool {
    pub fn new(max: u32) -> Self {
        Self {
            next: 0,
            max,
            free: VecDeque::new(),
        }
    }

    pub fn alloc(&mut self) -> Option<u32> {
        if self.next < self.max {
            self.next += 1;
            return Some(self.next - 1);
        }
        self.free.pop_front()
    }

    pub fn free(&mut self, id: u32) {
        self.free.push_back(id);
    }

    /// Marks `id` as used (adopting pinned state). False if it already was.
    pub fn reserve(&mut self, id: u32) -> bool {
        if id >= self.max {
            return false;
        }
        while self.next <= id {
            self.free.push_back(self.next);
            self.next += 1;
        }
        let before = self.free.len();
        self.free.retain(|&f| f != id);
        before != self.free.len()
    }
}

/// First-fit allocator of `[start, start + len)` ranges in the Maglev pool.
#[derive(Debug)]
pub struct RegionPool {
    /// Free ranges, sorted by start, never adjacent.
    free: Vec<(u32, u32)>,
}

impl RegionPool {
    pub fn new(size: u32) -> Self {
        Self {
            free: vec![(0, size)],
        }
    }

    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (start, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (start + len, l - len);
        }
        Some(start)
    }

    pub fn free(&mut self, start: u32, len: u32) {
        let i = self.free.partition_point(|&(s, _)| s < start);
        self.free.insert(i, (start, len));
        // Merge with the next, then with the previous range.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

impl RegionPool {
    /// Marks a range as used (adopting pinned state). False if any of it is taken.
    pub fn reserve(&mut self, start: u32, len: u32) -> bool {
        let Some(i) = self
            .free
            .iter()
            .position(|&(s, l)| s <= start && start + len <= s + l)
        else {
            return false;
        };
        let (s, l) = self.free.remove(i);
        if start + len < s + l {
            self.free.insert(i, (start + len, s + l - start - len));
        }
        if s < start {
            self.free.insert(i, (s, start - s));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_reused_oldest_first_after_the_fresh_ones() {
        let mut p = IdPool::new(3);
        assert_eq!((p.alloc(), p.alloc()), (Some(0), Some(1)));
        p.free(0);
        assert_eq!(p.alloc(), Some(2));
        p.free(1);
        assert_eq!((p.alloc(), p.alloc(), p.alloc()), (Some(0), Some(1), None));
    }

    #[test]
    fn reserving_marks_ids_and_ranges_taken() {
        let mut ids = IdPool::new(10);
        assert!(ids.reserve(3));
        assert!(!ids.reserve(3), "already taken");
        let got: Vec<_> = std::iter::from_fn(|| ids.alloc()).collect();
        assert_eq!(got.len(), 9);
        assert!(!got.contains(&3));
        let mut r = RegionPool::new(100);
        assert!(r.reserve(10, 20));
        assert!(!r.reserve(15, 2), "overlaps a reserved range");
        assert_eq!(r.alloc(10), Some(0));
        assert_eq!(r.alloc(10), Some(30));
    }

    #[test]
    fn regions_split_and_merge() {
        let mut p = RegionPool::new(100);
        let a = p.alloc(30).unwrap();
        let b = p.alloc(30).unwrap();
        let c = p.alloc(40).unwrap();
        assert_eq!((a, b, c), (0, 30, 60));
        assert_eq!(p.alloc(1), None);
        p.free(b, 30);
        p.free(a, 30);
        assert_eq!(p.alloc(60), Some(0), "freed neighbours merge");
        p.free(0, 60);
        p.free(c, 40);
        assert_eq!(
            p.alloc(100),
            Some(0),
            "everything merged back into one range"
        );
    }
}
