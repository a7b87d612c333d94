//! The `MAGLEV` map, written through a shared memory mapping (the map is
//! created with BPF_F_MMAPABLE): filling a 65537-entry table is 65537 stores,
//! not 65537 syscalls. The caller publishes a table only afterwards, with a
//! `SERVICES` update, and that syscall orders the stores before it.
//!
//! The kernel lays array elements out 8 bytes apart (`round_up(value_size,
//! 8)`), so entry i of our u32 values sits at byte 8 * i of the mapping.

use std::{
    io,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use aya::maps::MapData;

/// Bytes between two array elements in the mapping.
const STRIDE: usize = 8;

pub struct MaglevPool {
    // Keeps the map (and so the mapping's backing) alive.
    _map: MapData,
    base: NonNull<u32>,

    entries: u32,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only written through `&mut self`.
unsafe impl Send for MaglevPool {}

impl MaglevPool {
    pub fn new(map: MapData, entries: u32) -> io::Result<Self> {
        let page = 4096usize;
        let len = (entries as usize * STRIDE).div_ceil(page) * page;
        // SAFETY: mapping a BPF array map fd as its documented shared memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u32>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self {
            _map: map,
            base,
            entries,
            len,
        })
    }

    /// Writes `values` starting at entry `start`.
    pub fn write(&mut self, start: u32, values: impl ExactSizeIterator<Item = u32>) {
        assert!(
            start as usize + values.len() <= self.entries as usize,
            "Maglev write past the pool"
        );
        for (i, v) in values.enumerate() {
            // SAFETY: in bounds (asserted above); volatile because the kernel reads it.
            unsafe { self.slot(start as usize + i).write_volatile(v) };
        }
    }

    /// Reads `len` entries starting at `start`.
    pub fn read(&self, start: u32, len: u32) -> Vec<u32> {
        assert!(
            start as u64 + len as u64 <= self.entries as u64,
            "Maglev read past the pool"
        );
        (0..len as usize)
            // SAFETY: in bounds (asserted above).
            .map(|i| unsafe { self.slot(start as usize + i).read_volatile() })
            .collect()
    }
}

impl MaglevPool {
    /// Address of entry `i`; the caller checks `i < entries`.
    fn slot(&self, i: usize) -> *mut u32 {
        // SAFETY: within the mapping for i < entries (STRIDE * entries <= len).
        unsafe {
            self.base
                .as_ptr()
                .cast::<u8>()
                .add(i * STRIDE)
                .cast::<u32>()
        }
    }
}

impl Drop for MaglevPool {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
