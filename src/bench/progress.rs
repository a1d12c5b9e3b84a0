//! Progress bars on a terminal, nothing otherwise (a pipe or a log gets the table only).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Progress(ProgressBar);

impl Progress {
    /// A bar of `len` steps labelled `what`, drawn on stderr only when it is a terminal.
    pub fn new(what: &str, len: u64) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(len),
            if std::io::stderr().is_terminal() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) =
            ProgressStyle::with_template("{msg:>24} [{bar:30}] {pos}/{len} {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        Self(bar)
    }

    pub fn set(&self, pos: u64) {
        self.0.set_position(pos);
    }

    pub fn inc(&self, n: u64) {
        self.0.inc(n);
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl Progress {
    /// The underlying bar, to update from another task.
    pub fn clone_handle(&self) -> ProgressBar {
        self.0.clone()
    }
}
