//! The `MAGLEV` map, read and written through shared memory mappings (the
//! map is created with BPF_F_MMAPABLE): filling a 65537-entry table is 65537
//! stores, not 65537 syscalls. The agent publishes a table only afterwards,
//! with a `SERVICES` update, and that syscall orders the stores before it.
//! lbctl maps the same pages read-only.
//!
//! Only the pages a write or read touches are mapped, and only while it
//! runs: the pool can be hundreds of megabytes, and a mapping kept open would
//! count all of it in the agent's resident memory.
//!
//! The kernel lays array elements out 8 bytes apart (`round_up(value_size,
//! 8)`), so entry i of our u32 values sits at byte 8 * i of the map.

use std::{io, os::fd::AsFd};

use aya::maps::MapData;
use lb_common::ServiceInfo;

use crate::sys::SharedMapping;

/// Bytes between two array elements in the mapping.
const STRIDE: usize = 8;
const PAGE: usize = 4096;

pub struct MaglevPool {
    map: MapData,
    entries: u32,
    writable: bool,
}

/// A mapping of part of the pool, unmapped on drop.
struct Window {
    mapping: SharedMapping,
    /// Byte offset in the map of the mapping's start.
    offset: usize,
}

impl Window {
    fn slot(&self, entry: usize) -> *mut u32 {
        let at = entry * STRIDE - self.offset;
        assert!(
            at + 4 <= self.mapping.size(),
            "Maglev entry outside its window"
        );
        // Within the mapping (asserted above), so a valid pointer.
        self.mapping.base().wrapping_add(at).cast::<u32>()
    }
}

impl MaglevPool {
    /// The pool for reading and writing (the agent).
    pub fn new(map: MapData) -> io::Result<Self> {
        Self::open(map, true)
    }

    /// The pool for reading only (lbctl).
    pub fn read_only(map: MapData) -> io::Result<Self> {
        Self::open(map, false)
    }

    fn open(map: MapData, writable: bool) -> io::Result<Self> {
        let entries = map.info().map_err(io::Error::other)?.max_entries();
        let pool = Self {
            map,
            entries,
            writable,
        };
        // Fail early if the map cannot be mapped at all (a map created
        // without BPF_F_MMAPABLE by an old agent).
        drop(pool.window(0, 1)?);
        Ok(pool)
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Maps the pages holding entries `start..start + len`.
    fn window(&self, start: u32, len: u32) -> io::Result<Window> {
        if start as u64 + len as u64 > self.entries as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "MAGLEV entries {start}..{} are past the pool ({} entries)",
                    start as u64 + len as u64,
                    self.entries
                ),
            ));
        }
        let first = start as usize * STRIDE;
        let end = (start as usize + len as usize) * STRIDE;
        let offset = first / PAGE * PAGE;
        let map_len = (end - offset).div_ceil(PAGE) * PAGE;
        // A page-aligned range of a BPF array map's descriptor.
        let mapping = SharedMapping::new(self.map.fd().as_fd(), offset, map_len, self.writable)?;
        Ok(Window { mapping, offset })
    }

    /// Writes `values` starting at entry `start`.
    pub fn write(
        &mut self,
        start: u32,
        values: impl ExactSizeIterator<Item = u32>,
    ) -> io::Result<()> {
        assert!(self.writable, "writing a read-only Maglev pool");
        let w = self.window(start, values.len() as u32)?;
        for (i, v) in values.enumerate() {
            // SAFETY: in the window; volatile because the kernel reads it.
            unsafe { w.slot(start as usize + i).write_volatile(v) };
        }
        Ok(())
    }

    /// Reads `len` entries starting at `start`.
    pub fn read(&self, start: u32, len: u32) -> io::Result<Vec<u32>> {
        let w = self.window(start, len)?;
        // SAFETY: in the window.
        Ok((0..len as usize)
            .map(|i| unsafe { w.slot(start as usize + i).read_volatile() })
            .collect())
    }

    /// Entry `idx`.
    pub fn get(&self, idx: u32) -> io::Result<u32> {
        Ok(self.read(idx, 1)?[0])
    }

    /// The live table of a service (backend ids); empty when it has no
    /// backends (the data plane then drops new flows).
    pub fn live_table(&self, info: &ServiceInfo) -> io::Result<Vec<u32>> {
        if info.backend_count == 0 || info.table_size == 0 {
            return Ok(Vec::new());
        }
        self.read(info.live_start(), info.table_size)
    }
}
