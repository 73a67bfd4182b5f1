/**
 * jupyter-lmsp's JupyterLab extension: a left-sidebar panel for the local language-model
 * service (LMSP 1.0 at `{base_url}lmsp/v1/`), its tasks, models, pairing requests and clients.
 */

import type {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ILayoutRestorer } from '@jupyterlab/application';
import { Dialog, ICommandPalette, MainAreaWidget, showDialog } from '@jupyterlab/apputils';

import { TaskLogWidget } from './eventlog';
import { lmspIcon } from './icon';
import { SidebarModel } from './model';
import { notifyPairings } from './notify';
import { SidebarWidget } from './sidebar';
import type { IClient } from './types';

export const PLUGIN_ID = 'jupyter-lmsp-labextension:sidebar';
export const SIDEBAR_ID = 'jp-lmsp-sidebar';

export const CommandIDs = {
  open: 'lmsp:open-sidebar',
  openLog: 'lmsp:open-task-log'
} as const;

async function confirmRevoke(client: IClient): Promise<boolean> {
  const result = await showDialog({
    title: 'Revoke paired client',
    body: `"${client.name}" will no longer be able to call the service with its token.`,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Revoke' })]
  });
  return result.button.accept;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'A sidebar for the local language-model service (LMSP).',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const model = new SidebarModel();
    const openLog = (taskId: string): void => {
      void app.commands.execute(CommandIDs.openLog, { taskId });
    };
    const panel = new SidebarWidget({ model, openLog, confirmRevoke });
    panel.id = SIDEBAR_ID;
    panel.title.icon = lmspIcon;
    panel.title.caption = 'Language models (LMSP)';
    app.shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, SIDEBAR_ID);

    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Language Model Service Sidebar',
      execute: () => app.shell.activateById(SIDEBAR_ID)
    });
    app.commands.addCommand(CommandIDs.openLog, {
      label: 'Open Task Event Log',
      execute: args => {
        const taskId = typeof args.taskId === 'string' ? args.taskId : '';
        if (!taskId) {
          return;
        }
        const id = `jp-lmsp-log-${taskId}`;
        for (const widget of app.shell.widgets('main')) {
          if (widget.id === id) {
            app.shell.activateById(id);
            return;
          }
        }
        const content = new TaskLogWidget(model.client, taskId);
        const widget = new MainAreaWidget({ content });
        widget.id = id;
        widget.title.label = content.title.label;
        widget.title.caption = content.title.caption;
        widget.title.icon = lmspIcon;
        app.shell.add(widget, 'main', { mode: 'split-right' });
        app.shell.activateById(id);
      }
    });
    palette?.addItem({ command: CommandIDs.open, category: 'Language Models' });

    notifyPairings(model, panel, () => app.shell.activateById(SIDEBAR_ID));
    void app.restored.then(() => model.start());
  }
};

export default plugin;
