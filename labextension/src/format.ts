/** Small display helpers: ages, sizes, digests. */

/** "5s", "3m", "2h", "4d" from a Unix time (seconds) to now. */
export function age(unixSeconds: number, now: number = Date.now() / 1000): string {
  const s = Math.max(0, Math.floor(now - unixSeconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)}h`;
  }
  return `${Math.floor(s / 86400)}d`;
}

/** "1.2 MB" (decimal units, as disk tools show them). */
export function size(bytes: number | undefined): string {
  if (bytes === undefined) {
    return '—';
  }
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : 1;
  return `${value.toFixed(digits)} ${units[unit] ?? ''}`;
}

/** "sha256:0123456789ab" from a full digest (12 hex digits, as container tools show). */
export function shortDigest(digest: string | null | undefined): string {
  if (!digest) {
    return '—';
  }
  const [algorithm, hex] = digest.includes(':') ? digest.split(':', 2) : ['', digest];
  const short = (hex ?? '').slice(0, 12);
  return algorithm ? `${algorithm}:${short}` : short;
}

/** A local time for a Unix time, for tooltips. */
export function localTime(unixSeconds: number): string {
  return new Date(unixSeconds * 1000).toLocaleString();
}

/** "850ms", "12.3s", "4m 05s", "2h 10m": how long something took. */
export function duration(seconds: number): string {
  const s = Math.max(0, seconds);
  if (s < 1) {
    return `${Math.round(s * 1000)}ms`;
  }
  if (s < 60) {
    return `${s.toFixed(1)}s`;
  }
  if (s < 3600) {
    const whole = Math.floor(s);
    return `${Math.floor(whole / 60)}m ${String(whole % 60).padStart(2, '0')}s`;
  }
  const minutes = Math.floor(s / 60);
  return `${Math.floor(minutes / 60)}h ${String(minutes % 60).padStart(2, '0')}m`;
}
