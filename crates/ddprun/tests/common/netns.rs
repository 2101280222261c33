//! Two "hosts" made of network namespaces joined by veth pairs (10.77.0.1/24 and 10.77.0.2/24,
//! plus a second network 10.78.0.0/24 on `dat0`/`dat1`); deleted on drop, so also when a test
//! fails. Each launcher also gets its own mount namespace with its own `/dev/shm` (a fresh
//! tmpfs, or a directory the test chose and can inspect), so the two hosts share no memory (and
//! their host ids differ). Used by `collective.rs` and the fault-injection suite `chaos.rs`.

use super::{Running, DDPRUN};
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub struct TwoHosts {
    pub ns: [String; 2],
    /// Directories bind-mounted on each host's `/dev/shm` (`None`: a fresh tmpfs per launcher).
    shm: Option<[PathBuf; 2]>,
}

/// `ip ARGS`, its stderr as the error.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether `program` is on PATH.
pub fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why network namespaces cannot be made here (not root, `ip` or `unshare` missing), if so.
pub fn missing_prerequisite() -> Option<String> {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (ip netns)".into());
    }
    if !have("ip") || !have("unshare") || !have("mount") {
        return Some("`ip`, `unshare` or `mount` not found (install iproute2, util-linux)".into());
    }
    None
}

impl TwoHosts {
    pub const ADDRS: [&'static str; 2] = ["10.77.0.1", "10.77.0.2"];
    /// A second network between the hosts (interfaces `dat0`, `dat1`), for `DDP_SOCKET_IFNAME`.
    pub const DATA_ADDRS: [&'static str; 2] = ["10.78.0.1", "10.78.0.2"];

    /// Namespaces `ddprun-PID-0` and `ddprun-PID-1`.
    pub fn new() -> Result<TwoHosts, String> {
        Self::named("ddprun")
    }

    /// Namespaces `TAG-PID-0` and `TAG-PID-1`.
    pub fn named(tag: &str) -> Result<TwoHosts, String> {
        let id = std::process::id();
        let hosts = TwoHosts {
            ns: [format!("{tag}-{id}-0"), format!("{tag}-{id}-1")],
            shm: None,
        };
        let [a, b] = &hosts.ns;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        for (link, addrs) in [("veth", Self::ADDRS), ("dat", Self::DATA_ADDRS)] {
            let (d0, d1) = (format!("{link}0"), format!("{link}1"));
            ip(&[
                "link", "add", &d0, "netns", a, "type", "veth", "peer", "name", &d1, "netns", b,
            ])?;
            for (i, ns) in hosts.ns.iter().enumerate() {
                let dev = format!("{link}{i}");
                let addr = format!("{}/24", addrs[i]);
                ip(&["-n", ns, "addr", "add", &addr, "dev", &dev])?;
                ip(&["-n", ns, "link", "set", &dev, "up"])?;
            }
        }
        for ns in &hosts.ns {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Bind-mount `dirs[i]` on host `i`'s `/dev/shm` instead of a fresh tmpfs, so that the test
    /// can list what the launchers left there after they are gone.
    pub fn with_shm_dirs(mut self, dirs: [PathBuf; 2]) -> TwoHosts {
        self.shm = Some(dirs);
        self
    }

    /// Set host `i`'s end of the first veth pair (`veth{i}`) up or down: down cuts the hosts
    /// apart (a partition); connections survive it if it is short.
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let dev = format!("veth{i}");
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns[i], "link", "set", &dev, state])
    }

    /// Bytes sent so far through interface `dev` of host `i`.
    pub fn tx_bytes(&self, i: usize, dev: &str) -> u64 {
        let path = format!("/sys/class/net/{dev}/statistics/tx_bytes");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns[i], "cat", &path])
            .output()
            .expect("ip netns exec cat");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// `ddprun ARGS` as a launcher on host `i`.
    pub fn ddprun(&self, i: usize, args: &[&str]) -> Running {
        self.ddprun_env(i, args, &[])
    }

    /// `ddprun ARGS` on host `i` with extra environment variables. `ip netns exec`, `unshare`
    /// and `sh` all exec, so the pid of the returned process is the launcher's.
    pub fn ddprun_env(&self, i: usize, args: &[&str], env: &[(&str, &str)]) -> Running {
        let shm = match &self.shm {
            None => "mount -t tmpfs tmpfs /dev/shm".to_string(),
            Some(dirs) => format!("mount --bind '{}' /dev/shm", dirs[i].display()),
        };
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.ns[i],
            "unshare",
            "--mount",
            "sh",
            "-c",
        ])
        .arg(format!(r#"{shm} && exec "$0" "$@""#))
        .arg(DDPRUN)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        Running::start(cmd)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            // Deleting a namespace also deletes its end of the veth pair.
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// `sh -c CMD`, its stderr as the error.
pub fn sh(cmd: &str) -> Result<(), String> {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A tmpfs the test mounted (a host's `/dev/shm` directory, a tiny checkpoint disk),
/// unmounted on drop, so also when the test fails.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    /// Mount a tmpfs with `opts` (e.g. `size=1m`) at `at`, creating the directory.
    pub fn mount(at: &std::path::Path, opts: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).map_err(|e| format!("{}: {e}", at.display()))?;
        sh(&format!(
            "mount -t tmpfs -o {opts} tmpfs '{}'",
            at.display()
        ))?;
        Ok(Tmpfs(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if sh(&format!("umount '{}'", self.0.display())).is_err() {
            let _ = sh(&format!("umount -l '{}'", self.0.display()));
        }
    }
}
