/** Activity: throughput and time to first token over the last minutes (sparklines), the
 * queue, and what the last start-up recovered — from GET /lmsp/v1/metrics. */

import * as React from 'react';

import type { IPoint } from '../metrics';
import type { SidebarModel } from '../model';
import { Section } from './common';

const WIDTH = 64;
const HEIGHT = 16;

/** A polyline of `values` (nulls are gaps), scaled to its own maximum. */
export function Sparkline(props: {
  name: string;
  values: (number | null)[];
}): React.ReactElement {
  const { values } = props;
  const max = Math.max(0, ...values.map(v => v ?? 0));
  const step = values.length > 1 ? WIDTH / (values.length - 1) : WIDTH;
  const segments: string[][] = [[]];
  values.forEach((v, i) => {
    if (v === null) {
      segments.push([]);
      return;
    }
    const y = max > 0 ? HEIGHT - (v / max) * (HEIGHT - 2) - 1 : HEIGHT - 1;
    segments[segments.length - 1]?.push(`${(i * step).toFixed(1)},${y.toFixed(1)}`);
  });
  return (
    <svg
      className="jp-LMSP-sparkline"
      data-sparkline={props.name}
      data-points={values.length}
      width={WIDTH}
      height={HEIGHT}
      viewBox={`0 0 ${WIDTH} ${HEIGHT}`}
    >
      {segments
        .filter(points => points.length > 1)
        .map((points, i) => (
          <polyline key={i} points={points.join(' ')} fill="none" stroke="currentColor" />
        ))}
      {segments
        .filter(points => points.length === 1)
        .map((points, i) => {
          // A lone value (gaps on both sides): a dot.
          const [x, y] = (points[0] ?? '0,0').split(',');
          return <circle key={`dot${i}`} cx={x} cy={y} r={1.5} fill="currentColor" />;
        })}
    </svg>
  );
}

function last<T>(points: IPoint[], pick: (p: IPoint) => T | null): T | null {
  for (const point of [...points].reverse()) {
    const v = pick(point);
    if (v !== null) {
      return v;
    }
  }
  return null;
}

export function ActivityView(props: { model: SidebarModel }): React.ReactElement {
  const { data: activity, error } = props.model.activity;
  if (!activity) {
    return (
      <Section title="Activity" name="activity" error={error}>
        {null}
      </Section>
    );
  }
  const { points } = activity;
  const rate = last(points, p => p.tokensPerSecond);
  const ttft = last(points, p => p.ttft);
  return (
    <Section title="Activity" name="activity" error={error}>
      <dl className="jp-LMSP-facts">
        <dt>tokens/s</dt>
        <dd data-field="throughput">
          <span className="jp-LMSP-figure">{rate === null ? '–' : rate.toFixed(1)}</span>
          <Sparkline name="throughput" values={points.map(p => p.tokensPerSecond)} />
        </dd>
        <dt>first token</dt>
        <dd data-field="ttft">
          <span className="jp-LMSP-figure">
            {ttft === null ? '–' : `${(ttft * 1000).toFixed(0)} ms`}
          </span>
          <Sparkline name="ttft" values={points.map(p => p.ttft)} />
        </dd>
        <dt>queue</dt>
        <dd data-field="queue">
          {activity.queueDepth} waiting, {activity.active} running
        </dd>
        <dt>last start-up</dt>
        <dd data-field="recovered">
          {activity.recovered.length === 0
            ? 'nothing to recover'
            : activity.recovered
                .map(
                  r =>
                    `${r.tasks} ${r.previousState} (${r.policy}) → ${r.outcome}`
                )
                .join(', ')}
        </dd>
      </dl>
    </Section>
  );
}
