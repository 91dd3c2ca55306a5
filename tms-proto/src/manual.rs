//! One manual page for a command-line tool with subcommands (`tms-ctl man`, `relax-colocate
//! man`): clap_mangen renders a page per subcommand, which nothing installs; this puts every
//! subcommand's usage and options into the program's one page. Behind the `cli` feature: only
//! the tools need clap.

use std::io::Write;

/// The manual page of `cmd`: clap_mangen's sections for the program, then a COMMANDS section with
/// every subcommand's usage and options (clap_mangen's own would point at a page per subcommand,
/// which nothing installs), then the exit codes and the rest.
pub fn render(cmd: clap::Command, out: &mut dyn Write) -> std::io::Result<()> {
    let bin = cmd.get_name().to_string();
    let man = clap_mangen::Man::new(cmd.clone());
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    man.render_options_section(out)?;
    writeln!(out, ".SH COMMANDS")?;
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let mut usage = sub.clone().bin_name(format!("{bin} {}", sub.get_name()));
        let line = usage.render_usage().to_string();
        let line = line.trim_start_matches("Usage: ");
        writeln!(out, ".SS \"{}\"", roff_escape(line))?;
        if let Some(about) = sub.get_long_about().or(sub.get_about()) {
            writeln!(out, "{}", roff_escape(&about.to_string()))?;
        }
        for arg in sub.get_arguments().filter(|a| !a.is_hide_set() && a.get_id() != "help") {
            let names: Vec<String> = match (arg.get_short(), arg.get_long()) {
                (Some(s), Some(l)) => vec![format!("-{s}"), format!("--{l}")],
                (None, Some(l)) => vec![format!("--{l}")],
                (Some(s), None) => vec![format!("-{s}")],
                (None, None) => Vec::new(),
            };
            let value = match arg.get_value_names() {
                Some(v) => v.iter().map(|n| format!("<{n}>")).collect::<Vec<_>>().join(" "),
                None => format!("<{}>", arg.get_id().as_str().to_uppercase()),
            };
            let head = if names.is_empty() {
                value
            } else if arg.get_action().takes_values() {
                format!("{} {value}", names.join(", "))
            } else {
                names.join(", ")
            };
            writeln!(out, ".TP\n\\fB{}\\fR", roff_escape(&head))?;
            let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
            writeln!(out, "{}", roff_escape(&help))?;
        }
    }
    man.render_extra_section(out)?;
    man.render_version_section(out)?;
    Ok(())
}

/// Text as roff reads it: backslashes and hyphens escaped, no line starting with a control
/// character.
pub fn roff_escape(text: &str) -> String {
    text.replace('\\', "\\e")
        .replace('-', "\\-")
        .lines()
        .map(|l| if l.starts_with('.') || l.starts_with('\'') { format!("\\&{l}") } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n")
}
