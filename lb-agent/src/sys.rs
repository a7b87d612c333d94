//! The C library and system calls the agent makes itself, as small safe
//! functions: every `unsafe` block they need is here, each with why it is
//! sound, and the rest of the crate calls these instead of `libc`.
//!
//! Left where they are: the `bpf` batch lookup (`maps::batch`), whose
//! soundness depends on the map's key and value sizes, and the volatile
//! accesses to a mapped Maglev pool (`maps::maglev`), which are memory
//! accesses rather than calls.

use std::{
    ffi::{CStr, CString},
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    time::Duration,
};

/// The number of CPUs online (at least 1).
pub fn online_cpus() -> i64 {
    // SAFETY: sysconf reads a value and has no other effect.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1)
}

/// Asks glibc to give freed heap pages back to the kernel (musl does so by
/// itself, so there it does nothing).
pub fn malloc_trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `statfs`'s `f_type` of the filesystem holding `path`.
pub fn filesystem_type(path: &CStr) -> io::Result<i64> {
    // SAFETY: a zeroed statfs is valid plain data for statfs to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statfs to write to.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// The running kernel's release (`uname -r`); empty if uname fails.
pub fn kernel_release() -> String {
    // SAFETY: uname fills the zeroed struct; its fields are NUL-terminated.
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return String::new();
        }
        CStr::from_ptr(u.release.as_ptr())
            .to_string_lossy()
            .into_owned()
    }
}

/// `clock` (`CLOCK_MONOTONIC`, ...) now, in nanoseconds.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Moves the calling thread into a new network namespace of its own.
pub fn unshare_network_namespace() -> io::Result<()> {
    // SAFETY: unshares this thread's network namespace only.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Interfaces.

/// The index of interface `name`, if there is one.
pub fn if_nametoindex(name: &CStr) -> Option<u32> {
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (i != 0).then_some(i)
}

/// The name of the interface with index `index`, as the kernel's bytes.
pub fn if_indextoname(index: u32) -> Option<Vec<u8>> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer holds IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into `buf`.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_bytes().to_vec())
}

/// What an interface address entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfAddress {
    /// An IPv4 or IPv6 address and its prefix length.
    Ip(IpAddr, u8),
    /// A 6-byte hardware address (an `AF_PACKET` entry).
    Mac([u8; 6]),
}

/// One entry of `getifaddrs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddrEntry {
    pub interface: CString,
    pub address: IfAddress,
}

/// Every address of every interface, in the kernel's order: IP addresses
/// that have a netmask and 6-byte hardware addresses; other entries are
/// left out. Empty if getifaddrs fails.
pub fn interface_addresses() -> Vec<IfAddrEntry> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs fills a list we walk read-only and free once. Each
    // entry's address is of the family it says, and its netmask (when not
    // null) of the same family; an AF_PACKET entry's address is a
    // sockaddr_ll.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return out;
        }
        let mut cur = list;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() {
                continue;
            }
            let has_mask = !ifa.ifa_netmask.is_null();
            let address = match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET if has_mask => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in);
                    let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                    let len = u32::from_be(m.sin_addr.s_addr).count_ones() as u8;
                    IfAddress::Ip(ip.into(), len)
                }
                libc::AF_INET6 if has_mask => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in6);
                    let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                    let len = u128::from_be_bytes(m.sin6_addr.s6_addr).count_ones() as u8;
                    IfAddress::Ip(ip.into(), len)
                }
                libc::AF_PACKET => {
                    let ll = &*(ifa.ifa_addr as *const libc::sockaddr_ll);
                    if ll.sll_halen != 6 {
                        continue;
                    }
                    let mut mac = [0u8; 6];
                    mac.copy_from_slice(&ll.sll_addr[..6]);
                    IfAddress::Mac(mac)
                }
                _ => continue,
            };
            out.push(IfAddrEntry {
                interface: CStr::from_ptr(ifa.ifa_name).to_owned(),
                address,
            });
        }
        libc::freeifaddrs(list);
    }
    out
}

/// `SIOCETHTOOL` and `ETHTOOL_GDRVINFO` (linux/sockios.h, linux/ethtool.h).
const SIOCETHTOOL: libc::c_ulong = 0x8946;
const ETHTOOL_GDRVINFO: u32 = 0x3;

/// `struct ethtool_drvinfo`.
#[repr(C)]
struct DrvInfo {
    cmd: u32,
    driver: [u8; 32],
    version: [u8; 32],
    fw_version: [u8; 32],
    bus_info: [u8; 32],
    erom_version: [u8; 32],
    reserved2: [u8; 12],
    n_priv_flags: u32,
    n_stats: u32,
    testinfo_len: u32,
    eedump_len: u32,
    regdump_len: u32,
}

/// The driver name `ETHTOOL_GDRVINFO` reports for `iface`.
pub fn ethtool_driver(iface: &str) -> io::Result<String> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: zeroed plain-data structs; the ioctl writes at most
    // size_of::<DrvInfo>() bytes to the pointer it is given; the socket is
    // closed on every path.
    unsafe {
        let mut info: DrvInfo = std::mem::zeroed();
        info.cmd = ETHTOOL_GDRVINFO;
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(iface.bytes()) {
            *dst = src as libc::c_char;
        }
        req.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let rc = libc::ioctl(fd, SIOCETHTOOL as _, &mut req);
        let err = io::Error::last_os_error();
        libc::close(fd);
        if rc < 0 {
            return Err(err);
        }
        let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
        Ok(String::from_utf8_lossy(&info.driver[..end]).into_owned())
    }
}

// ---------------------------------------------------------------------------
// Sockets.

/// A new raw socket of `domain` and `protocol`, close-on-exec.
fn raw_socket(domain: libc::c_int, protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor we just opened and own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `sendto(2)` of `buf` to the address `to`.
fn send_to<A>(fd: BorrowedFd<'_>, buf: &[u8], to: &A) -> io::Result<usize> {
    // SAFETY: buffer and address with their lengths; `A` is a sockaddr
    // type (the callers' sockaddr_ll and sockaddr_nl).
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            0,
            (to as *const A).cast(),
            std::mem::size_of::<A>() as u32,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// An AF_PACKET raw socket for sending only (protocol 0 receives nothing).
pub fn packet_socket() -> io::Result<OwnedFd> {
    raw_socket(libc::AF_PACKET, 0)
}

/// Sends the Ethernet frame `frame` to `dst` out of interface `ifindex`.
pub fn send_frame(fd: BorrowedFd<'_>, ifindex: u32, dst: [u8; 6], frame: &[u8]) -> io::Result<()> {
    // SAFETY: a zeroed sockaddr_ll is valid; we fill the fields sendto reads.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_ifindex = ifindex as i32;
    sa.sll_halen = 6;
    sa.sll_addr[..6].copy_from_slice(&dst);
    send_to(fd, frame, &sa).map(drop)
}

/// A netlink socket of `protocol` (`NETLINK_ROUTE`, `NETLINK_NETFILTER`).
pub fn netlink_socket(protocol: libc::c_int) -> io::Result<OwnedFd> {
    raw_socket(libc::AF_NETLINK, protocol)
}

/// Sends `request` to the kernel on a netlink socket.
pub fn send_to_kernel(fd: BorrowedFd<'_>, request: &[u8]) -> io::Result<()> {
    // SAFETY: a zeroed sockaddr_nl is valid, and with the family set it is
    // the kernel's address (pid 0).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    send_to(fd, request, &addr).map(drop)
}

/// One datagram of `fd` into `buf`; its length.
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for its length; `fd` is open.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Makes a receive on `fd` fail after `timeout` (`SO_RCVTIMEO`).
pub fn set_recv_timeout(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        // `as _`: the two types' widths differ between libc targets.
        tv_sec: timeout.as_secs() as _,
        tv_usec: timeout.subsec_micros() as _,
    };
    // SAFETY: a valid option of the right size on an open descriptor.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::addr_of!(tv).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Shared memory.

/// A shared mapping of `len` bytes of a file (a BPF map) from a
/// page-aligned offset, unmapped on drop.
pub struct SharedMapping {
    base: *mut u8,
    len: usize,
}

impl SharedMapping {
    pub fn new(fd: BorrowedFd<'_>, offset: usize, len: usize, writable: bool) -> io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new mapping chosen by the kernel, overlapping nothing of
        // ours; failure is reported, not undefined.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            base: p.cast(),
            len,
        })
    }

    /// The first byte of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The mapping's length in bytes.
    pub fn size(&self) -> usize {
        self.len
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped, once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
