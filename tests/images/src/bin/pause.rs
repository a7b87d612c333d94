//! The Pod sandbox's process (the "pause" container): it holds the Pod's
//! namespaces open, reaps the zombies a shared PID namespace leaves with it,
//! and exits at once on SIGTERM or SIGINT (as PID 1 it would ignore them
//! without a handler, and the kubelet would wait out its grace period).

fn main() {
    // SAFETY: sigprocmask/sigwait on a set built here; no handlers run.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, sig);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        loop {
            let mut sig = 0;
            if libc::sigwait(&set, &mut sig) != 0 {
                continue;
            }
            if sig == libc::SIGCHLD {
                while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {}
            } else {
                std::process::exit(0);
            }
        }
    }
}
