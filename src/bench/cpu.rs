//! CPU seconds and memory of the processes a benchmark loads, read from /proc: the
//! worker processes lapse runs, every PostgreSQL process, every RabbitMQ (`beam.smp`)
//! process. The services are machine-wide, so their figures include whatever else
//! the machine runs meanwhile; the report says so.

use std::fs;

/// Linux reports process times in USER_HZ ticks, fixed at 100 per second.
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU seconds consumed so far (own time plus reaped children's).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CpuSample {
    pub postgres: f64,
    pub rabbitmq: f64,
    pub machine: f64,
}

/// `(comm, utime + stime + cutime + cstime)` of one process, in seconds.
fn process_cpu(pid: &str) -> Option<(String, f64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_string();
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks: u64 = (11..=14)
        .map(|i| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum();
    Some((comm, ticks as f64 / TICKS_PER_SECOND))
}

/// CPU seconds of one process (0 once it is gone).
pub fn of_pid(pid: u32) -> f64 {
    process_cpu(&pid.to_string()).map_or(0.0, |(_, s)| s)
}

/// Busy CPU seconds of the whole machine (all cores), from /proc/stat.
fn machine_busy() -> f64 {
    let Ok(stat) = fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().next() else {
        return 0.0;
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
    let busy: u64 = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4 && *i < 8)
        .map(|(_, x)| *x)
        .sum();
    busy as f64 / TICKS_PER_SECOND
}

/// Reads every process once.
pub fn sample() -> CpuSample {
    let mut s = CpuSample {
        machine: machine_busy(),
        ..CpuSample::default()
    };
    let Ok(dir) = fs::read_dir("/proc") else {
        return s;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        match process_cpu(pid) {
            Some((comm, secs)) if comm == "postgres" || comm.starts_with("postgres:") => {
                s.postgres += secs
            }
            Some((comm, secs)) if comm == "beam.smp" => s.rabbitmq += secs,
            _ => {}
        }
    }
    s
}

/// Resident set size (current, peak) of a process in MiB, from /proc/PID/status.
pub fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |key: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Load average over the last minute, to put next to every measurement.
pub fn load_average() -> f64 {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_process() {
        let me = std::process::id();
        assert!(of_pid(me) >= 0.0);
        let (rss, peak) = rss_mib(me).expect("own status");
        assert!(rss > 0.0 && peak >= rss);
        assert!(sample().machine > 0.0);
    }
}
