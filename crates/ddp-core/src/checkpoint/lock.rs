//! One job per checkpoint directory: an exclusive OS file lock on `<dir>/.ddp-lock`.
//!
//! Two jobs writing one directory overwrite each other's checkpoints (plain ones silently; save
//! sets leave orphans). [`lock_dir`] takes an advisory exclusive lock (`flock`) on a lock file in
//! the directory and keeps it until the process exits: the kernel drops it with the process, so
//! a job killed with `kill -9` never blocks the next start. The file records who holds it (host
//! and pid), and a second job is refused with that name. Locking the same directory again in the
//! same process is a no-op (ranks running as threads of one test process, a resumed loop).

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Name of the lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = ".ddp-lock";

/// How long a start waits for a lock held by another process before refusing: long enough for
/// a job being replaced (an elastic restart) to finish exiting.
const WAIT: Duration = Duration::from_secs(3);

/// The locks this process holds, by directory; their files stay open (and locked) until exit.
static HELD: Mutex<Vec<(PathBuf, File)>> = Mutex::new(Vec::new());

/// Takes the exclusive lock of checkpoint directory `dir` (which must exist) for the rest of
/// this process, or fails naming the job that holds it (host and pid, as it wrote them).
pub fn lock_dir(dir: &Path) -> Result<()> {
    let key = fs::canonicalize(dir).map_err(|e| Error::io("cannot resolve", dir, e))?;
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if held.iter().any(|(d, _)| *d == key) {
        return Ok(());
    }
    let path = key.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io("cannot open the checkpoint directory's lock", &path, e))?;
    let start = Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) if start.elapsed() < WAIT => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() {
                    "another process (it has not written its name yet)".to_string()
                } else {
                    holder.chars().take(200).collect()
                };
                return Err(Error::InvalidArgument(format!(
                    "checkpoint directory {} is in use by another job ({holder}; lock file {}): \
                     two jobs writing one directory would overwrite each other's checkpoints. \
                     Give this job its own --checkpoint-dir, or stop the other one",
                    key.display(),
                    path.display()
                )));
            }
            Err(TryLockError::Error(e)) => {
                return Err(Error::io("cannot lock the checkpoint directory", &path, e))
            }
        }
    }
    let me = format!(
        "host {} pid {}\n",
        ddp_comm::host::hostname(),
        std::process::id()
    );
    let written = file
        .set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(me.as_bytes()));
    // The lock holds without the name: a failure to write it only makes a refusal less precise.
    if let Err(e) = written {
        tracing::warn!("cannot write the holder into {}: {e}", path.display());
    }
    held.push((key, file));
    Ok(())
}
